"""Writes each job's outcome: one atomic script per job (result + counters + results stream + XACK).

Outcomes wait in an in-memory outbox until written, in completion order. A finished result is dropped
only when the write proves moot (its batch is gone); any other failure, an unreachable server or an
error reply (OOM under maxmemory, READONLY after a failover, NOSCRIPT after a flush), keeps it held
and retried with backoff. A retried write is harmless: the script does nothing but the XACK for a
job that already has its outcome.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Any, cast

import redis
from sluice.jobs.consumer.commands import Outcome, batch_exists, record
from sluice.jobs.pipes import NodePipes
from sluice.jobs.scripts import Scripts
from sluice.jobs.store import retire_batch

log = logging.getLogger(__name__)

# BusyLoadingError is a ConnectionError. On a cluster: no node serves the slot (yet), or the cluster is down.
# RedisClusterException: no node could be reached to learn the cluster's layout.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError, redis.exceptions.ClusterDownError,
              redis.exceptions.RedisClusterException)
CHUNK = 256  # outcomes per pipeline round trip

__all__ = ["CHUNK", "REDIS_DOWN", "Outcome", "WriteHeld", "Writer", "Written"]


@dataclass
class Written:
    outcome: Outcome
    fresh: bool  # False: the job already had its outcome (a redelivery, or cancelled meanwhile)


class WriteHeld(Exception):
    """Some outcomes got an error reply and stay held, to be retried (the first error is the message)."""


class Writer:
    """Filled by the step loop, flushed by one background thread."""

    def __init__(self) -> None:
        self.outbox: deque[Outcome] = deque()
        self._lock = threading.Lock()  # a deque must not change while a chunk is copied out of it

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self.outbox.append(outcome)

    def __len__(self) -> int:
        return len(self.outbox)

    def entry_ids(self) -> set[str]:
        """Stream entries whose outcome waits here: still pending in Redis, but not orphans."""
        with self._lock:
            return {o.entry_id for o in self.outbox if o.entry_id}

    def flush(self, r: redis.Redis, scripts: Scripts, now: float) -> list[Written]:
        """Write everything held, oldest first. Raises REDIS_DOWN with the unwritten rest still held, and
        WriteHeld after writing what could be when some got error replies (those stay held, in order)."""
        written: list[Written] = []
        kept: list[tuple[Outcome, Exception]] = []
        try:
            while self.outbox:
                with self._lock:
                    chunk = list(islice(self.outbox, CHUNK))
                pipes = NodePipes(r)
                for o in chunk:
                    record(scripts, pipes, o, now)
                replies = pipes.execute()
                written.extend(self._settle(r, chunk, replies, now, kept))
        finally:
            if kept:
                with self._lock:
                    self.outbox.extendleft(o for o, _ in reversed(kept))
        if kept:
            o, e = kept[0]
            raise WriteHeld(f"{len(kept)} outcomes held, e.g. {o.batch_id}:{o.idx}: {type(e).__name__}: {e}")
        return written

    def _settle(self, r: redis.Redis, chunk: list[Outcome], replies: list[object], now: float,
                kept: list[tuple[Outcome, Exception]]) -> list[Written]:
        out = []
        for o, reply in zip(chunk, replies, strict=True):
            if isinstance(reply, REDIS_DOWN):
                raise reply  # this outcome and the ones after it stay held
            with self._lock:
                self.outbox.popleft()
            if isinstance(reply, Exception):
                if batch_exists(r, o.batch_id):
                    kept.append((o, reply))
                else:  # the batch was deleted meanwhile: nothing left to write it to
                    log.warning("dropping the outcome of %s:%s, its batch is gone: %s", o.batch_id, o.idx, reply)
                continue
            fresh, final = cast(list[Any], reply)
            out.append(Written(o, bool(fresh)))
            if final:
                _retire(r, o.batch_id, now)
        return out


def _retire(r: redis.Redis, batch_id: str, now: float) -> None:
    try:
        retire_batch(r, batch_id, now)
    except REDIS_DOWN:
        pass  # housekeeping retires final batches left in the open set
    except redis.ResponseError as e:
        log.warning("retiring %s failed (housekeeping retries it): %s", batch_id, e)
