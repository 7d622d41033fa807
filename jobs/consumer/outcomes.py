"""The outcomes a worker writes for jobs that did not run to a completion: settled without running
(cancelled, expired, refused), dead-lettered, or unreadable in the stream."""

from __future__ import annotations

import logging
import time

import redis
from sluice.jobs.consumer import commands as consumer
from sluice.jobs.consumer.commands import Delivery, Outcome, Pulled, Unreadable
from sluice.jobs.schemas import DeadLetter, ErrorInfo, Job, Result, ResultTimings

log = logging.getLogger(__name__)


def bare_result(job: Job, status: str, code: str, message: str, worker: str | None = None,
                model: str | None = None) -> Result:
    """The outcome of a job that did not run to its end (cancelled, expired, failed)."""
    return Result(job_id=job.id, custom_id=job.custom_id, batch_id=job.batch_id, idx=job.idx, kind=job.kind,
                  model=job.model or model, status=status, error=ErrorInfo(code=code, message=message),
                  worker=worker, timings=ResultTimings(submitted=job.created_at or None, finished=time.time()))


def failed_instead(result: Result, code: str, message: str) -> Result:
    """A failed result in place of ``result``, which cannot be written: the same job, worker, usage and
    timings, nothing of what it produced."""
    return Result(job_id=result.job_id, custom_id=result.custom_id, batch_id=result.batch_id, idx=result.idx,
                  kind=result.kind, model=result.model, status="failed", error=ErrorInfo(code=code, message=message),
                  worker=result.worker, usage=result.usage, timings=result.timings)


def refused(o: Outcome, why: str) -> Outcome:
    """A failed outcome (``result_refused``) in place of ``o``, whose write the job server refused."""
    message = f"the job server refused to store this job's result: {why}"
    try:
        res = failed_instead(Result.model_validate_json(o.result_json), "result_refused", message)
    except ValueError:  # not a Result (it never is not): the job's coordinates are enough
        res = Result(job_id=f"{o.batch_id}:{o.idx}", custom_id="", batch_id=o.batch_id, idx=o.idx, status="failed",
                     error=ErrorInfo(code="result_refused", message=message), timings=ResultTimings(finished=time.time()))
    return Outcome(o.batch_id, o.idx, "failed", res.model_dump_json(exclude_none=True), o.stream, o.entry_id,
                   stands_in=True)


def settled(d: Delivery, status: str, code: str, message: str, worker: str, model: str) -> Outcome:
    res = bare_result(d.job, status, code, message, worker, model)
    return Outcome(d.batch_id, d.job.idx, status, res.model_dump_json(exclude_none=True), d.stream, d.entry_id)


def dead_letter(d: Delivery, error: str, worker: str, model: str) -> Outcome:
    """A failed result naming the deliveries, plus the dead-letter entry (job, error) beside it."""
    message = f"gave up after {d.deliveries} deliveries; last error: {error}"
    res = bare_result(d.job, "failed", "dead_letter", message, worker, model)
    dead = DeadLetter(idx=d.job.idx, custom_id=d.job.custom_id, error=error, deliveries=d.deliveries, worker=worker,
                      job=d.job.model_dump(mode="json", exclude_none=True)).model_dump_json()
    return Outcome(d.batch_id, d.job.idx, "failed", res.model_dump_json(exclude_none=True), d.stream, d.entry_id,
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
