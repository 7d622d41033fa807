"""The worker's spans of a job's trace (jobs/tracing.py has the design): recorded when the job finishes,
from the times the worker and the engine kept, as children of the job's ``sluice.submit`` span. Nothing
when tracing is off or the job carries no traceparent."""

from __future__ import annotations

from sluice.engine.embedding_engine import EmbeddingOutput
from sluice.engine.outputs import Completion
from sluice.jobs import tracing
from sluice.worker.held import Held


def job_finished(h: Held, out: Completion | EmbeddingOutput, worker_id: str) -> None:
    tp = h.job.traceparent
    if tp is None or not tracing.enabled():
        return
    attrs = {**tracing.job_attributes(h.job.id, h.job.batch_id), "sluice.worker": worker_id}
    t = out.timings
    tracing.record("sluice.claim", tp, h.claim_started, h.pulled_at, attrs)
    admitted = t.admitted
    tracing.record("sluice.admission", tp, t.queued, admitted, attrs)
    tracing.record("sluice.first_token", tp, admitted, t.first_token, attrs)
    tracing.record("sluice.finish", tp, t.first_token, t.finished, attrs)
