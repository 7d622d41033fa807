"""Writes each job's outcome: one atomic script per job (result + counters + results stream + XACK).

Outcomes wait in an in-memory outbox until written, in completion order; when Redis is unreachable
they stay there and go out on reconnect. A retried write is harmless: the script does nothing but
the XACK for a job that already has its outcome.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from itertools import islice

import redis

from jobs import keys
from jobs.scripts import Scripts
from jobs.store import retire_batch

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError)  # BusyLoadingError is a ConnectionError
CHUNK = 256  # outcomes per pipeline round trip


@dataclass
class Outcome:
    batch_id: str
    idx: int
    status: str  # completed | failed | cancelled | expired
    result_json: str
    stream: str = ""  # the job stream entry to acknowledge ("" for none)
    entry_id: str = ""
    dead_json: str = ""  # set for a dead-lettered job


@dataclass
class Written:
    outcome: Outcome
    fresh: bool  # False: the job already had its outcome (a redelivery, or cancelled meanwhile)


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
        """Write everything held, oldest first. Raises REDIS_DOWN with the unwritten rest still held."""
        written: list[Written] = []
        while self.outbox:
            with self._lock:
                chunk = list(islice(self.outbox, CHUNK))
            pipe = r.pipeline(transaction=False)
            for o in chunk:
                _record(scripts, pipe, o, now)
            replies = pipe.execute(raise_on_error=False)
            written.extend(self._settle(r, chunk, replies, now))
        return written

    def _settle(self, r: redis.Redis, chunk: list[Outcome], replies: list[object], now: float) -> list[Written]:
        out = []
        for o, reply in zip(chunk, replies, strict=True):
            if isinstance(reply, REDIS_DOWN):
                raise reply  # this outcome and the ones after it stay held
            with self._lock:
                self.outbox.popleft()
            if isinstance(reply, Exception):
                # Not retryable (e.g. the batch was deleted meanwhile): retrying would loop forever.
                log.error("writing the outcome of %s:%s failed: %s", o.batch_id, o.idx, reply)
                continue
            fresh, final = reply  # type: ignore[misc]
            out.append(Written(o, bool(fresh)))
            if final:
                _retire(r, o.batch_id, now)
        return out


def _record(scripts: Scripts, pipe: redis.client.Pipeline, o: Outcome, now: float) -> None:
    bid = o.batch_id
    ks = [keys.meta(bid), keys.done(bid), keys.results(bid), o.stream or keys.meta(bid), keys.dead(bid)]
    args = [o.idx, o.status, o.result_json, o.entry_id, o.dead_json, now, keys.GROUP]
    scripts.record(keys=ks, args=args, client=pipe)


def _retire(r: redis.Redis, batch_id: str, now: float) -> None:
    try:
        retire_batch(r, batch_id, now)
    except REDIS_DOWN:
        pass  # housekeeping retires final batches left in the open set
