"""What a worker's engine serves (generation, embeddings, or scores: a cross-encoder), and the job <->
engine conversions for each: an embeddings line on a generation model's queue, a score line on a model
that cannot score, or the reverse, fails that job alone."""

from __future__ import annotations

import time
from typing import Any

from sluice.engine.cross_encoder import PairRequest
from sluice.engine.embedding_engine import EmbeddingOutput, EmbeddingRequest
from sluice.engine.outputs import Completion, Request
from sluice.jobs.embeddings import EMBEDDINGS_URL, encode_base64
from sluice.jobs.schemas import CHAT_URL, COMPLETIONS_URL, ErrorInfo, Job, Result, ResultTimings, ResultUsage
from sluice.jobs.scoring import KIND_URLS, SCORE_KINDS
from sluice.worker.convert import completion_to_result, job_to_request
from sluice.worker.lora import job_adapter
from sluice.worker.scoring import score_request, score_result

GENERATION, EMBEDDING, SCORE = "generation", "embedding", "score"
# The job kinds each kind of engine runs: an embedding model scores by cosine, a cross-encoder by its classifier.
_RUNS = {GENERATION: ("chat", "completion"), EMBEDDING: ("embedding", *SCORE_KINDS), SCORE: SCORE_KINDS}


def serves(engine: Any) -> str:
    """``generation``, ``embedding`` or ``score`` (engine/protocol.py's ``serves``)."""
    return str(engine.serves)


def engine_request(job: Job, rid: str, engine: Any) -> Request | EmbeddingRequest | PairRequest:
    """The engine request of a job; a ValueError (the job fails as invalid_request) when the engine
    serves another kind, or refuses the job's settings."""
    kind = serves(engine)
    if job.kind not in _RUNS.get(kind, ()):
        raise ValueError(_refusal(job, kind))
    if job.kind in SCORE_KINDS:
        return score_request(job, rid, kind)
    if kind == EMBEDDING:
        assert job.input is not None
        return EmbeddingRequest(rid, job.input, job.dimensions)
    req = job_to_request(job, rid, engine.vocab_size)
    req.lora = job_adapter(job.model, engine)
    return req


def _refusal(job: Job, kind: str) -> str:
    url = {"chat": CHAT_URL, "completion": COMPLETIONS_URL, "embedding": EMBEDDINGS_URL, **KIND_URLS}.get(job.kind)
    if kind == EMBEDDING:
        return (f"this model serves embeddings: a {job.kind} request cannot run on it "
                "(send /v1/embeddings, /v1/score or /v1/rerank lines, or use a generation model's queue)")
    if kind == SCORE:
        return (f"this model is a cross-encoder (it scores pairs of texts): a {url} request cannot run on it "
                "(send /v1/score or /v1/rerank lines)")
    if job.kind in SCORE_KINDS:
        return (f"this model generates text: a {url} request cannot run on it (send it to an embedding or "
                "cross-encoder model's queue)")
    return "this model generates text: a /v1/embeddings request cannot run on it (send it to an embedding model's queue)"


def probe_request(probe: Request, engine: Any) -> Request | EmbeddingRequest | PairRequest:
    """The isolation probe (a generation request) in the engine's own kind."""
    kind = serves(engine)
    if kind == SCORE:
        return PairRequest(probe.request_id, [("probe", "probe")])
    return EmbeddingRequest(probe.request_id, "probe") if kind == EMBEDDING else probe


def engine_result(job: Job, out: Completion | EmbeddingOutput, engine: Any, *, started: float | None,
                  worker: str | None, model: str | None) -> Result:
    if isinstance(out, EmbeddingOutput) and job.kind in SCORE_KINDS:
        return score_result(job, out, serves(engine), started=started, worker=worker, model=model)
    if isinstance(out, EmbeddingOutput):
        return embedding_result(job, out, started=started, worker=worker, model=model)
    return completion_to_result(job, out, engine.tokenizer, started=started, worker=worker, model=model)


def embedding_result(job: Job, out: EmbeddingOutput, *, started: float | None = None, worker: str | None = None,
                     model: str | None = None) -> Result:
    """A finished embedding request as the job's Result: each vector as base64 float32 (exact and
    compact; rendered in the job's encoding_format when read)."""
    failed = out.error is not None or out.finish_reason == "error"
    return Result(
        job_id=job.id, custom_id=job.custom_id, batch_id=job.batch_id, idx=job.idx, kind="embedding",
        model=job.model or model, status="failed" if failed else "completed",
        finish_reason=out.finish_reason, usage=ResultUsage(prompt_tokens=out.prompt_tokens),
        timings=ResultTimings(submitted=job.created_at or None, started=started, first_token=out.timings.first_token,
                              finished=out.timings.finished or time.time()),
        worker=worker, embeddings=None if failed else [encode_base64(v) for v in out.embeddings],
        encoding_format=job.encoding_format,
        error=ErrorInfo(code="invalid_request", message=out.error or "the engine refused the request") if failed else None,
    )

