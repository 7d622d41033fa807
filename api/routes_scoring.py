"""vLLM's scoring endpoints on the queue: ``POST /v1/score`` (and ``/score``) and ``POST /v1/rerank`` (and
``/rerank``, ``/v2/rerank``), each one job at the interactive priority like ``/v1/embeddings``
(api/routes_openai.py), answered as vLLM's ScoreResponse / RerankResponse (jobs/scoring.py). They run on
an embedding model's queue (cosine of the two texts' vectors) or a cross-encoder's (its classifier)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from sluice.api.routes_openai import serve_once
from sluice.jobs.scoring import RERANK_URLS, SCORE_URLS

router = APIRouter(tags=["scoring"])


def _route(url: str) -> None:
    async def handler(request: Request, body: Annotated[dict[str, Any], Body()]) -> Any:
        return await serve_once(request, body, url)

    what = "Scores of pairs of texts" if url in SCORE_URLS else "Documents ranked by relevance to a query"
    router.add_api_route(url, handler, methods=["POST"], summary=f"{what}, run on the queue (vLLM's shape)")


for _url in SCORE_URLS + RERANK_URLS:
    _route(_url)
