"""The FastAPI app: OpenAI's Files and Batches APIs, native jobs and results, health and metrics.

``create_app()`` builds a fresh app (tests build their own); ``sluice serve`` runs
``uvicorn --factory sluice.api.app:create_app``. Everything under ``/v1`` needs ``Authorization: Bearer
$SLUICE_API_KEY`` (or ``x-api-key``) when that variable is set; ``/healthz``, ``/metrics`` and the OpenAPI
schema do not.
Limits (``sluice.api.settings``): upload size, requests per batch file, prompt characters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sluice.api import (
    dashboard,
    errors,
    routes_batches,
    routes_files,
    routes_jobs,
    routes_openai,
    routes_retry,
)
from sluice.api.gate import Gate
from sluice.api.metrics import OpenAIMetrics, make_registry, request_labels
from sluice.api.routes_anthropic import router as anthropic_router
from sluice.api.routes_control import router as control_router
from sluice.api.routes_queues import router as queues_router
from sluice.api.routes_responses import router as responses_router
from sluice.api.routes_scoring import router as scoring_router
from sluice.api.settings import Settings
from sluice.api.state import AppState, State, require_key
from sluice.api.validation import max_line_bytes
from sluice.api.webhooks import deliver_forever
from sluice.jobs.connection import is_cluster
from sluice.jobs.settings import load
from sluice.jobs.store import list_workers
from starlette.concurrency import run_in_threadpool

FILE_SWEEP_EVERY = 60.0  # seconds between deletions of expired files


def create_app(settings: Settings | None = None) -> FastAPI:
    state = AppState(settings or load(Settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(_sweep_files(state))
        hooks = asyncio.create_task(deliver_forever(state))  # batch events to webhooks (api/webhooks.py)
        yield
        sweeper.cancel()
        hooks.cancel()
        state.close()

    app = FastAPI(title="Sluice", version="0.1.0", lifespan=lifespan,
                  description="Bulk LLM generation with OpenAI's Batch API (Files + Batches), native single jobs "
                              "and progressive results.")
    app.state.sluice = state
    errors.install(app)
    auth = [Depends(require_key)]
    for r in (routes_files.router, routes_batches.router, routes_jobs.router, routes_openai.router,
              control_router):
        app.include_router(r, dependencies=auth)
    app.include_router(routes_retry.router, dependencies=auth)  # dead letters, requeue, retry (issue 43)
    app.include_router(anthropic_router, dependencies=auth)  # Anthropic's Messages and Message Batches
    app.include_router(queues_router, dependencies=auth)  # each model's backlog, for autoscalers (issue 47)
    app.include_router(scoring_router, dependencies=auth)  # vLLM's /v1/score and /v1/rerank (issue 42)
    app.include_router(responses_router, dependencies=auth)  # OpenAI's Responses API (issue 42)
    app.include_router(dashboard.router)  # pages at / and /batches/{id}; its data routes check the key
    app.add_api_route("/v1/models", list_models, methods=["GET"], dependencies=auth, tags=["models"],
                      summary="The models live workers serve")
    app.add_api_route("/healthz", healthz, methods=["GET"], tags=["ops"], summary="Health of the API and job server")
    registry, requests = make_registry(state.redis)
    app.state.openai_metrics = OpenAIMetrics(registry)
    app.add_api_route("/metrics", _metrics_route(registry), methods=["GET"], tags=["ops"],
                      response_class=Response, summary="Prometheus metrics")
    s = state.settings  # the gate: the key and the body's size are checked before anything reads the body
    app.add_middleware(Gate, key=s.api_key, max_upload=s.max_upload_bytes, max_body=max_line_bytes(s.max_prompt_chars))
    app.middleware("http")(_middleware(requests))  # outside the gate: its 401s and 413s are counted too
    app.openapi = _openapi_with_400(app)  # type: ignore[method-assign]
    return app


async def _sweep_files(state: AppState) -> None:
    """Housekeeping for the files on disk: expired uploads and batch output files are deleted."""
    while True:
        try:
            await run_in_threadpool(state.files.delete_expired)
        except OSError:
            pass  # a full or vanished disk: the next sweep tries again
        await asyncio.sleep(FILE_SWEEP_EVERY)


def list_models(state: State) -> dict[str, Any]:
    serves: dict[str, set[str]] = {}
    quantization: dict[str, set[str]] = {}
    parallelism: dict[str, set[str]] = {}
    adapters: dict[str, str] = {}  # "base:adapter" -> base
    for w in list_workers(state.redis()):
        queue = w.queue_name
        serves.setdefault(queue, set()).add(w.serves)  # generation | embedding | score
        quantization.setdefault(queue, set()).add(w.quantization)  # engine/quant/methods.py's name
        # how each worker splits the model: "one device" or "tensor parallel N (gloo|nccl)"
        parallelism.setdefault(queue, set()).add(w.parallelism)
        for name in w.adapters:  # LoRA adapters, named as lines name them
            adapters[f"{queue}:{name}"] = queue
    data = [{"id": q, "object": "model", "created": 0, "owned_by": "sluice", "serves": sorted(serves[q]),
             "quantization": sorted(quantization[q]), "parallelism": sorted(parallelism[q])} for q in sorted(serves)]
    data += [{"id": a, "object": "model", "created": 0, "owned_by": "sluice", "serves": ["generation"],
              "parent": base} for a, base in sorted(adapters.items())]
    return {"object": "list", "data": data}


def healthz(state: State) -> JSONResponse:
    try:
        r = state.redis()
        workers = list_workers(r)
        replica_of = None if is_cluster(r) else _read_only_replica_of(r)
    except (redis.RedisError, OSError, RuntimeError) as e:
        return JSONResponse({"status": "unavailable", "job_server": f"{type(e).__name__}: {e}"}, status_code=503)
    models = sorted({w.queue_name for w in workers})
    if replica_of is not None:
        # Reads work but nothing can be submitted: unhealthy, so the deployment notices and repoints the API.
        return JSONResponse({"status": "read_only", "job_server": f"a read-only replica of {replica_of}: "
                             "submissions answer 503; point SLUICE_REDIS_URL at the primary",
                             "workers": len(workers), "models": models}, status_code=503)
    return JSONResponse({"status": "ok", "job_server": "ok", "workers": len(workers), "models": models})


def _read_only_replica_of(r: redis.Redis) -> str | None:
    """The primary's address when the job server is a read-only replica (INFO, not CONFIG: managed
    servers often rename CONFIG away)."""
    info = r.info("replication")
    if info.get("role") not in ("slave", "replica") or not int(info.get("slave_read_only", 1)):
        return None
    return f"{info.get('master_host')}:{info.get('master_port')}"


def _metrics_route(registry: Any) -> Callable[[], Awaitable[Response]]:
    async def metrics() -> Response:
        body = await run_in_threadpool(generate_latest, registry)  # the collector reads Redis
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return metrics


def _middleware(requests: Any) -> Callable[..., Awaitable[Response]]:
    async def middleware(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        requests.labels(*request_labels(request.scope, response.status_code)).inc()
        return response

    return middleware


def _openapi_with_400(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The schema says what the API answers: 400 in OpenAI's error shape where FastAPI would say 422."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()
            error = {"description": "Invalid request (OpenAI's error shape; the message names the field or line)",
                     "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    responses = op.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = error
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


_ERROR_SCHEMA = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}, "required": ["message", "type"]}}, "required": ["error"]}
