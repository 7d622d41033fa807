"""Periodic upkeep, run by workers on a timer (one at a time, under a lock): expire batches past
their completion window and jobs past their deadline, retire finished batches, and delete the
results of batches finished longer ago than the results TTL."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis

from jobs import keys
from jobs.schemas import FINAL_BATCH_STATUSES
from jobs.scripts import Scripts
from jobs.store import delete_batch, expire_batch, retire_batch

RESULTS_TTL = 30 * 24 * 3600.0  # seconds results are kept after their batch finished (as OpenAI's files)
DEADLINE_CHUNK = 1000


@dataclass
class HousekeepingReport:
    expired_batches: int = 0
    expired_jobs: int = 0
    retired: int = 0
    deleted: int = 0


def housekeep(r: redis.Redis, *, now: float | None = None, results_ttl: float = RESULTS_TTL,
              max_batches: int = 1000) -> HousekeepingReport:
    """One pass over open batches and old finished ones. Safe to run concurrently (every write is
    idempotent), but ``housekeep_if_due`` avoids the duplicated work."""
    now = now if now is not None else time.time()
    rep = HousekeepingReport()
    s = Scripts(r)
    for bid in r.zrange(keys.open_batches(), 0, max_batches - 1):
        _open_batch(r, s, bid, now, rep)
    old = r.zrangebyscore(keys.finished_batches(), "-inf", now - results_ttl, start=0, num=max_batches)
    for bid in old:
        delete_batch(r, bid)
        rep.deleted += 1
    return rep


def housekeep_if_due(r: redis.Redis, owner: str, every: float, **kw: float) -> HousekeepingReport | None:
    """``housekeep`` unless another process ran it less than ``every`` seconds ago."""
    if not r.set(keys.housekeeping_lock(), owner, nx=True, px=int(every * 1000)):
        return None
    return housekeep(r, **kw)


def _open_batch(r: redis.Redis, s: Scripts, bid: str, now: float, rep: HousekeepingReport) -> None:
    status, expires_at = r.hmget(keys.meta(bid), "status", "expires_at")
    if status is None:
        r.zrem(keys.open_batches(), bid)
    elif status in FINAL_BATCH_STATUSES:
        retire_batch(r, bid, now)  # its finisher died before retiring it
        rep.retired += 1
    elif status == "in_progress" and expires_at and float(expires_at) < now:
        rep.expired_batches += expire_batch(r, bid, now)
    else:
        rep.expired_jobs += expire_due_jobs(r, s, bid, now)


def expire_due_jobs(r: redis.Redis, s: Scripts, bid: str, now: float) -> int:
    """Jobs of ``bid`` whose deadline passed before they started get "expired"."""
    ks = [keys.meta(bid), keys.done(bid), keys.results(bid), keys.job_custom_ids(bid), keys.deadlines(bid)]
    total = 0
    while True:
        written, fin, due = s.expire_due(keys=ks, args=[now, bid, DEADLINE_CHUNK])
        total += int(written)
        if fin:
            retire_batch(r, bid, now)
        if int(due) < DEADLINE_CHUNK:
            return total
