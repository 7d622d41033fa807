"""The outcomes a worker writes for jobs that did not run to a completion: settled without running
(cancelled, expired, refused), dead-lettered, or unreadable in the stream."""

from __future__ import annotations

import json
import logging
import time

import redis

from jobs import consumer
from jobs.consumer import Delivery, Outcome, Pulled, Unreadable
from jobs.schemas import ErrorInfo, Result, ResultTimings
from worker.convert import bare_result

log = logging.getLogger(__name__)


def settled(d: Delivery, status: str, code: str, message: str, worker: str, model: str) -> Outcome:
    res = bare_result(d.job, status, code, message, worker, model)
    return Outcome(d.job.batch_id, d.job.idx, status, res.model_dump_json(exclude_none=True), d.stream, d.entry_id)


def dead_letter(d: Delivery, error: str, worker: str, model: str) -> Outcome:
    """A failed result naming the deliveries, plus the dead-letter entry (job, error) beside it."""
    message = f"gave up after {d.deliveries} deliveries; last error: {error}"
    res = bare_result(d.job, "failed", "dead_letter", message, worker, model)
    dead = json.dumps({"idx": d.job.idx, "custom_id": d.job.custom_id, "error": error, "deliveries": d.deliveries,
                       "worker": worker, "job": d.job.model_dump(mode="json", exclude_none=True)})
    return Outcome(d.job.batch_id, d.job.idx, "failed", res.model_dump_json(exclude_none=True), d.stream, d.entry_id,
                   dead)


def unreadable(u: Unreadable, worker: str, model: str) -> Outcome:
    assert u.idx is not None
    res = Result(job_id=f"{u.batch_id}:{u.idx}", custom_id="", batch_id=u.batch_id, idx=u.idx, status="failed",
                 error=ErrorInfo(code="unreadable_job", message=u.reason), worker=worker, model=model,
                 timings=ResultTimings(finished=time.time()))
    return Outcome(u.batch_id, u.idx, "failed", res.model_dump_json(exclude_none=True), u.stream, u.entry_id)


def unreadables(r: redis.Redis, p: Pulled, worker: str, model: str) -> list[Outcome]:
    """Failed outcomes for the entries of ``p`` that are not jobs, so their batch can finish; an entry
    without even a job index has nothing to record one under and is dropped."""
    out = []
    for u in p.unreadable:
        if u.idx is None:
            consumer.drop(r, u)
            continue
        log.error("job %s:%s is unreadable: %s", u.batch_id, u.idx, u.reason)
        out.append(unreadable(u, worker, model))
    return out
