"""Jobs that ended failed or expired, run again (issue 43): dead letters requeued (``sluice requeue``) and
a finished batch's failed and expired lines retried (``sluice retry``).

A reopened job keeps its idx and custom_id; its old outcome is taken back and the job queued again, in one
script per stream (``scripts.reopen``, a compare-and-set on the outcome read here), so its new outcome
replaces the old one exactly once: the counters, the results (the output and error files) and the dead
letters end as if it had run once. Its input comes from its dead letter, from what the outcome's write kept
(``keys.inputs``), or from its entry still in the job stream (a job expired before any worker took it).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass

import redis
from sluice.jobs import keys, spill
from sluice.jobs.consumer.commands import job_score, mark_ready
from sluice.jobs.schemas import Batch, DeadLetter, Job
from sluice.jobs.scripts import Scripts, reopen
from sluice.jobs.store import get_batch, priorities, retire_batch, settled

CHUNK = 500  # jobs per script call, so no single call holds the server long
RETRYABLE = ("failed", "expired")


class ReopenRefused(ValueError):
    """The batch (or the jobs named) cannot be run again; the message says why, in one line."""


@dataclass
class Candidate:
    job: Job
    status: str  # its outcome now: failed | expired
    old_entry: str = ""  # its entry still in the job stream
    dead_entry: str = ""  # its dead letter


@dataclass
class Reopened:
    batch: Batch
    queued: int = 0  # jobs queued again
    not_retryable: int = 0  # failed or expired jobs whose input is gone (an unreadable queue entry)


def dead_letter_entries(r: redis.Redis, batch_id: str) -> list[tuple[str, DeadLetter]]:
    """The batch's dead letters with their stream ids, oldest first."""
    return [(eid, DeadLetter.model_validate_json(f["d"])) for eid, f in r.xrange(keys.dead(batch_id))]


def requeue_dead_letters(r: redis.Redis, batch_id: str, custom_ids: list[str] | None) -> Reopened | None:
    """Queue again the dead-lettered jobs named by ``custom_ids`` (None: all of them); None if no such batch.
    A custom_id that has no dead letter is a ReopenRefused (nothing is requeued then)."""
    if get_batch(r, batch_id, max_errors=0) is None:
        return None
    dead = {dl.custom_id: (eid, dl) for eid, dl in dead_letter_entries(r, batch_id)}
    wanted = list(dead) if custom_ids is None else list(dict.fromkeys(custom_ids))
    missing = [c for c in wanted if c not in dead]
    if missing:
        raise ReopenRefused(f"no dead letter for custom_id {', '.join(map(repr, missing[:5]))}"
                            f"{' ...' if len(missing) > 5 else ''} in batch {batch_id}")
    found = [Candidate(Job.model_validate(dead[c][1].job), "failed", dead_entry=dead[c][0]) for c in wanted]
    return _reopen(r, batch_id, found, 0)


def retry_batch(r: redis.Redis, batch_id: str) -> Reopened | None:
    """Queue again every failed and expired job of a finished batch (completed or expired); None if no
    such batch."""
    batch = get_batch(r, batch_id, max_errors=0)
    if batch is None:
        return None
    if batch.status not in ("completed", "expired") or not settled(r, batch_id):
        raise ReopenRefused(f"batch {batch_id} is {batch.status}: only a completed or expired batch is retried "
                            "(`sluice requeue` runs its dead letters again meanwhile)")
    found = _failed_inputs(r, batch_id)
    dead = {dl.idx: eid for eid, dl in dead_letter_entries(r, batch_id)}
    for cand in found:
        cand.dead_entry = dead.get(cand.job.idx, "")
    counts = batch.counts
    return _reopen(r, batch_id, found, max(counts.failed + counts.expired - len(found), 0))


def _failed_inputs(r: redis.Redis, batch_id: str) -> list[Candidate]:
    """Every job of the batch whose outcome is failed or expired and whose input is at hand."""
    out = {}
    for idx, value in r.hgetall(keys.inputs(batch_id)).items():
        status, _, job = value.partition(" ")
        out[int(idx)] = Candidate(Job.model_validate_json(job), status)
    left = _stream_entries(r, batch_id, set(out))
    statuses = _statuses(r, batch_id, list(left))
    for idx, (eid, job) in left.items():
        if statuses.get(idx) in RETRYABLE:
            out[idx] = Candidate(job, statuses[idx], old_entry=eid)
    return [out[i] for i in sorted(out)]


def _stream_entries(r: redis.Redis, batch_id: str, skip: set[int]) -> dict[int, tuple[str, Job]]:
    """Entries left in the batch's job streams (jobs settled before a worker took them), by job idx."""
    out: dict[int, tuple[str, Job]] = {}
    for p in priorities(r, batch_id):
        for eid, f in r.xrange(keys.jobs(batch_id, p)):
            try:
                job = Job.model_validate_json(f["j"])
            except (KeyError, ValueError):
                continue  # unreadable: its failed outcome says so, and it cannot run again
            if job.idx not in skip:
                out[job.idx] = (eid, job)
    return out


def _statuses(r: redis.Redis, batch_id: str, idxs: list[int]) -> dict[int, str]:
    """The outcome status of each job that has one (read from the results, or their spilled files)."""
    rids = dict(zip(idxs, r.hmget(keys.done(batch_id), idxs), strict=True)) if idxs else {}
    out = {}
    for idx, rid in rids.items():
        if rid is None:
            continue
        got = r.xrange(keys.results(batch_id), rid, rid)
        raw = got[0][1]["r"] if got else spill.find(r, spill.files_dir(), batch_id, rid)
        if raw:
            out[idx] = json.loads(raw)["status"]
    return out


def _reopen(r: redis.Redis, batch_id: str, found: list[Candidate], not_retryable: int) -> Reopened:
    s = Scripts(r)
    now = time.time()
    queue, created = r.hmget(keys.meta(batch_id), "model", "created_at")
    queue = keys.queue_name(queue)
    rids = r.hmget(keys.done(batch_id), [c.job.idx for c in found]) if found else []
    by_stream: dict[str, list[tuple[Candidate, str]]] = defaultdict(list)
    for c, rid in zip(found, rids, strict=True):
        c.job.deadline = None  # asked to run again: it runs when a worker gets to it, not expired again at once
        if rid is not None:
            by_stream[keys.jobs(batch_id, c.job.priority)].append((c, rid))
    _index(r, batch_id, queue, float(created or now), {st: job_score(cs[0][0].job) for st, cs in by_stream.items()})
    queued = 0
    for stream, cands in by_stream.items():
        for i in range(0, len(cands), CHUNK):
            chunk = cands[i:i + CHUNK]
            n, status = reopen(s, batch_id, stream, [(c.job.idx, rid, c.status, c.job.model_dump_json(exclude_none=True),
                                                      c.old_entry, c.dead_entry) for c, rid in chunk], now)
            if n < 0:
                _reindex_if_final(r, batch_id, now)
                raise ReopenRefused(f"batch {batch_id} is {status}: its jobs cannot run again")
            queued += n  # fewer than the chunk where another reopen took a job first
        mark_ready(r, queue, stream, job_score(cands[0][0].job))
    _reindex_if_final(r, batch_id, now)
    batch = get_batch(r, batch_id)
    assert batch is not None
    return Reopened(batch, queued, not_retryable)


def _index(r: redis.Redis, batch_id: str, queue: str, created: float, streams: dict[str, float]) -> None:
    """Before reopening: the batch back among the open ones and its streams on the queue, so that
    housekeeping and claims see it even if this process dies right after the script."""
    if not streams:
        return
    pipe = r.pipeline(transaction=False)
    pipe.zadd(keys.open_batches(), {batch_id: created})
    pipe.zrem(keys.finished_batches(), batch_id)
    pipe.zadd(keys.active_streams(queue), streams)
    pipe.execute()


def _reindex_if_final(r: redis.Redis, batch_id: str, now: float) -> None:
    """Nothing was reopened (another reopen or a cancel came first): a final batch retired again."""
    if settled(r, batch_id) and r.hget(keys.meta(batch_id), "status") != "in_progress":
        retire_batch(r, batch_id, now)
