"""Score and rerank jobs (jobs/scoring.py) on the two kinds of model that score: an embedding model
(each distinct text embedded once; a pair's score is the cosine of its two vectors) and a cross-encoder
(engine/cross_encoder.py: each pair read together; its score comes back as a one-value vector)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from sluice.engine.cross_encoder import PairRequest
from sluice.engine.embedding_engine import EmbeddingOutput, EmbeddingRequest
from sluice.jobs.schemas import ErrorInfo, Job, Result, ResultTimings, ResultUsage
from sluice.jobs.scoring import ScoreInput, scored_entries

EMBEDDING, CROSS_ENCODER = "embedding", "score"  # what engines that score say they serve


def score_request(job: Job, rid: str, serves: str) -> EmbeddingRequest | PairRequest:
    assert job.score is not None
    if serves == CROSS_ENCODER:
        return PairRequest(rid, job.score.pairs())
    return EmbeddingRequest(rid, _texts(job.score))


def score_result(job: Job, out: EmbeddingOutput, serves: str, *, started: float | None, worker: str | None,
                 model: str | None) -> Result:
    """A finished score request as the job's Result: each pair's score (jobs/scoring.scored_entries)."""
    assert job.score is not None
    failed = out.error is not None or out.finish_reason == "error"
    entries = None
    if not failed:
        scores = [v[0] for v in out.embeddings] if serves == CROSS_ENCODER else _cosines(job.score, out.embeddings)
        entries = scored_entries(job.kind, job.score, scores)
    return Result(
        job_id=job.id, custom_id=job.custom_id, batch_id=job.batch_id, idx=job.idx, kind=job.kind,
        model=job.model or model, status="failed" if failed else "completed",
        finish_reason=out.finish_reason, usage=ResultUsage(prompt_tokens=out.prompt_tokens),
        timings=ResultTimings(submitted=job.created_at or None, started=started, first_token=out.timings.first_token,
                              finished=out.timings.finished or time.time()),
        worker=worker, scores=entries,
        error=ErrorInfo(code="invalid_request", message=out.error or "the engine refused the request") if failed else None,
    )


def _texts(inp: ScoreInput) -> list[str]:
    """The distinct texts of the pairs, in order of first use: each is embedded once."""
    return list(dict.fromkeys(inp.text_1 + inp.text_2))


def _cosines(inp: ScoreInput, vectors: list[list[float]]) -> list[float]:
    at = {t: v for t, v in zip(_texts(inp), vectors, strict=True)}
    return [_cosine(at[a], at[b]) for a, b in inp.pairs()]


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    # In float64 from the float32 vectors; a zero vector (never from a normalising model) scores 0.
    norm = math.sqrt(math.fsum(x * x for x in a) * math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0
