"""vLLM's ``/v1/score`` and ``/v1/rerank`` wire formats, in pure Python (no torch): a body checked into a
job's pairs of texts, and the scores a worker made rendered as vLLM's ScoreResponse / RerankResponse.

Score: ``text_1`` and ``text_2`` (or vLLM's newer names ``queries``/``documents``, ``queries``/``items``,
``data_1``/``data_2``), each a string or a list of strings: one ``text_1`` is scored against every
``text_2``, else they pair up in order. Rerank: ``query`` against each of ``documents`` (strings or
``{"text": ...}``), answered highest score first, the first ``top_n`` (0: all), with each document's
text unless ``return_documents`` is false. On an embedding model a pair's score is the cosine of the
two texts' vectors; on a cross-encoder (sequence classification, one label) it is the classifier's
output for the pair, after the model's activation (sentence-transformers' CrossEncoder's default).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SCORE_URL, RERANK_URL = "/v1/score", "/v1/rerank"
SCORE_URLS = (SCORE_URL, "/score")  # vLLM serves both
RERANK_URLS = (RERANK_URL, "/rerank", "/v2/rerank")  # vLLM's aliases (Jina's and Cohere's paths)
SCORING_URLS = SCORE_URLS + RERANK_URLS
SCORE_KINDS = ("score", "rerank")
SCORED_BY = ("embedding", "score")  # the workers that run them (a heartbeat's "serves"): embedding models, cross-encoders
KIND_URLS = {"score": SCORE_URL, "rerank": RERANK_URL}  # a batch's endpoint, by its jobs' kind
MAX_PAIRS = 2048  # pairs per request (as embeddings' inputs): all of them are in the one result the job writes

# vLLM's names for the two sides of a score request, newest first.
_PAIR_NAMES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))
_PAIR_FIELDS = frozenset(n for p in _PAIR_NAMES for n in p)
_SCORE_FIELDS = frozenset({"model", "user"}) | _PAIR_FIELDS
_RERANK_FIELDS = frozenset({"model", "user", "query", "documents", "top_n", "return_documents"})


class ScoreInput(BaseModel):
    """A score or rerank job's texts: ``text_1`` has one text (scored against each of ``text_2``) or as
    many as ``text_2`` (paired in order); a rerank job has its query as the one ``text_1``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text_1: list[str] = Field(min_length=1, max_length=MAX_PAIRS)
    text_2: list[str] = Field(min_length=1, max_length=MAX_PAIRS)
    top_n: int = Field(0, ge=0)  # rerank: the best top_n (0: all)
    return_documents: bool = True  # rerank: each result carries its document's text

    def pairs(self) -> list[tuple[str, str]]:
        first = self.text_1 * len(self.text_2) if len(self.text_1) == 1 else self.text_1
        return list(zip(first, self.text_2, strict=True))


class ScoreEntry(BaseModel):
    """One scored pair: ``index`` into text_2 (rerank: the document), its score, the document (rerank)."""

    index: int
    score: float
    document: str | None = None


# ---- a request body, checked ------------------------------------------------------------------------
def scoring_fields(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/score`` or ``/v1/rerank`` body (any of their aliases) as a Job's fields; a ValueError says
    what is wrong with it."""
    if url in RERANK_URLS:
        return {"kind": "rerank", "score": _rerank_input(body)}
    return {"kind": "score", "score": _score_input(body)}


def _score_input(body: dict[str, Any]) -> ScoreInput:
    unknown = sorted(set(body) - _SCORE_FIELDS)
    if unknown:
        raise ValueError(f"unsupported field(s) for /v1/score: {', '.join(unknown)}")
    given = set(body) & _PAIR_FIELDS
    named = [p for p in _PAIR_NAMES if set(p) == given]
    if not named:
        raise ValueError(f"body needs text_1 and text_2 (or queries and documents), each a string or a list of "
                         f"strings; it has {', '.join(sorted(given)) or 'neither'}")
    one, two = named[0]
    first, second = _texts(body[one], one), _texts(body[two], two)
    if len(first) != 1 and len(first) != len(second):
        raise ValueError(f"{one} has {len(first)} texts and {two} {len(second)}: give one {one}, or as many as {two}")
    return ScoreInput(text_1=first, text_2=second)


def _rerank_input(body: dict[str, Any]) -> ScoreInput:
    unknown = sorted(set(body) - _RERANK_FIELDS)
    if unknown:
        raise ValueError(f"unsupported field(s) for /v1/rerank: {', '.join(unknown)}")
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise ValueError("query must be a non-empty string")
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs:
        raise ValueError("documents must be a non-empty list of strings (or of {\"text\": ...} objects)")
    texts = _texts([d.get("text") if isinstance(d, dict) and set(d) == {"text"} else d for d in docs], "documents")
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise ValueError(f"top_n must be a non-negative integer (0: all), not {top_n!r}")
    ret = body.get("return_documents", True)
    if not isinstance(ret, bool):
        raise ValueError("return_documents must be a boolean")
    return ScoreInput(text_1=[query], text_2=texts, top_n=top_n or 0, return_documents=ret)


def _texts(value: Any, name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts:
        raise ValueError(f"{name} must be a string or a non-empty list of strings")
    if len(texts) > MAX_PAIRS:
        raise ValueError(f"{name} has {len(texts)} texts; at most {MAX_PAIRS} per request (split it into several)")
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t:
            raise ValueError(f"{name}[{i}] must be a non-empty string")
    return texts


def score_chars(inp: ScoreInput) -> int:
    """The characters a request scores (what the prompt limit applies to)."""
    return sum(len(a) + len(b) for a, b in inp.pairs())


# ---- the result ---------------------------------------------------------------------------------------
def scored_entries(kind: str, inp: ScoreInput, scores: list[float]) -> list[ScoreEntry]:
    """Each pair's score as the job's result: a score job's in pair order; a rerank job's highest first
    (ties in document order), its first top_n, each with its document unless return_documents is false."""
    if kind != "rerank":
        return [ScoreEntry(index=i, score=s) for i, s in enumerate(scores)]
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if inp.top_n:
        order = order[: inp.top_n]
    return [ScoreEntry(index=i, score=scores[i], document=inp.text_2[i] if inp.return_documents else None)
            for i in order]


def scoring_body(kind: str, request_id: str, model: str, entries: list[ScoreEntry], prompt_tokens: int,
                 created: int) -> dict[str, Any]:
    """vLLM's ScoreResponse (``score``) or RerankResponse (``rerank``)."""
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}
    if kind == "rerank":
        results = [{"index": e.index, **({} if e.document is None else {"document": {"text": e.document}}),
                    "relevance_score": e.score} for e in entries]
        return {"id": f"rerank-{request_id}", "model": model, "usage": usage, "results": results}
    data = [{"index": e.index, "object": "score", "score": e.score} for e in entries]
    return {"id": f"score-{request_id}", "object": "list", "created": created, "model": model, "data": data,
            "usage": usage}
