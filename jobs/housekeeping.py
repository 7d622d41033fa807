"""Periodic upkeep, run by workers on a timer (one at a time, under a lock): expire batches past
their completion window and jobs past their deadline, seal batches whose submitter is gone, retire
finished batches, and delete the results of batches finished longer ago than the results TTL."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import redis
from sluice.jobs import keys
from sluice.jobs.consumer.commands import restore_ready
from sluice.jobs.schemas import FINAL_BATCH_STATUSES
from sluice.jobs.scripts import Scripts, expire_due
from sluice.jobs.store import delete_batch, expire_batch, priorities, retire_batch
from sluice.jobs.submit import seal

log = logging.getLogger(__name__)

RESULTS_TTL = 30 * 24 * 3600.0  # seconds results are kept after their batch finished (as OpenAI's files)
SUBMIT_STALL = 600.0  # seconds a batch may stay unsealed without a new chunk before it is sealed as it is
DEADLINE_CHUNK = 1000
SCAN_COUNT = 1000


@dataclass
class HousekeepingReport:
    expired_batches: int = 0
    expired_jobs: int = 0
    retired: int = 0
    deleted: int = 0
    sealed: int = 0  # batches whose submitter stopped sending before the last line


def housekeep(r: redis.Redis, *, now: float | None = None, results_ttl: float = RESULTS_TTL,
              submit_stall: float = SUBMIT_STALL) -> HousekeepingReport:
    """One pass over every open batch and the finished ones past the TTL. Safe to run concurrently
    (every write is idempotent), but ``housekeep_if_due`` avoids the duplicated work."""
    now = now if now is not None else time.time()
    rep = HousekeepingReport()
    s = Scripts(r)
    # ZSCAN visits every member present for the whole scan, however many, in pages.
    for bid, _ in r.zscan_iter(keys.open_batches(), count=SCAN_COUNT):
        _open_batch(r, s, bid, now, rep, submit_stall)
    while True:
        old = r.zrangebyscore(keys.finished_batches(), "-inf", now - results_ttl, start=0, num=SCAN_COUNT)
        for bid in old:
            delete_batch(r, bid)
            rep.deleted += 1
        if len(old) < SCAN_COUNT:
            return rep


def housekeep_if_due(r: redis.Redis, owner: str, every: float, **kw: float) -> HousekeepingReport | None:
    """``housekeep`` unless another process ran it less than ``every`` seconds ago."""
    if not r.set(keys.housekeeping_lock(), owner, nx=True, px=int(every * 1000)):
        return None
    return housekeep(r, **kw)


def _open_batch(r: redis.Redis, s: Scripts, bid: str, now: float, rep: HousekeepingReport, stall: float) -> None:
    status, expires_at, sealed, touched = r.hmget(keys.meta(bid), "status", "expires_at", "sealed", "touched_at")
    if status in ("validating", "cancelling") and sealed != "1" and now - float(touched or 0) > stall:
        # Its submitter died mid-upload (or the last write was lost): what was queued is the batch.
        log.warning("sealing batch %s: no new lines for %.0fs, its submitter is gone", bid, stall)
        seal(r, s, bid, now, reason=f"submission stopped: no new lines for {stall:.0f}s")
        rep.sealed += 1
        return
    if status is None:
        r.zrem(keys.open_batches(), bid)
    elif status in FINAL_BATCH_STATUSES:
        retire_batch(r, bid, now)  # its finisher died before retiring it
        rep.retired += 1
    elif status == "in_progress" and expires_at and float(expires_at) < now:
        rep.expired_batches += expire_batch(r, bid, now)
    else:
        rep.expired_jobs += expire_due_jobs(r, s, bid, now)
        model, created, paused = r.hmget(keys.meta(bid), "model", "created_at", "paused_at")
        if paused:
            return  # its streams go back when it is resumed (jobs/pause.py)
        restore_ready(r, keys.queue_name(model), bid, priorities(r, bid), float(created or 0))


def expire_due_jobs(r: redis.Redis, s: Scripts, bid: str, now: float) -> int:
    """Jobs of ``bid`` whose deadline passed before they started get "expired"."""
    total = 0
    while True:
        written, fin, due = expire_due(s, bid, now, DEADLINE_CHUNK)
        total += written
        if fin:
            retire_batch(r, bid, now)
        if due < DEADLINE_CHUNK:
            return total
