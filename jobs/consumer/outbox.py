"""Writes each job's outcome: one atomic script per job (result + counters + results stream + XACK).

Outcomes wait in an in-memory outbox until written, in completion order. What a failed write means:

- the server is unreachable (a round trip fails and so does a PING): everything stays held, retried
  with backoff by the session (``REDIS_DOWN`` is raised);
- the server refuses every write for now (full under maxmemory, READONLY after a failover, loading, ...:
  ``SERVER_STATE``): those outcomes stay held and are retried with backoff (``WriteHeld``), the rest written;
- the server refuses this write (any other error reply, or it drops the connection on this write alone,
  twice, while it still answers PING, as it does past proto-max-bulk-len; once may be a restart): the job
  gets a small failed outcome (``result_refused``) in its place, so one result the server cannot take
  never blocks the others;
- the batch is gone: the outcome is dropped.

A retried write is harmless: the script does nothing but the XACK for a job that already has its outcome.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any, TypeVar, cast

import redis
from sluice.jobs import keys
from sluice.jobs.connection import is_cluster
from sluice.jobs.consumer.commands import Outcome, batch_exists, record
from sluice.jobs.consumer.outcomes import refused
from sluice.jobs.pipes import NodePipes
from sluice.jobs.scripts import Scripts
from sluice.jobs.store import retire_batch

log = logging.getLogger(__name__)
T = TypeVar("T")

# BusyLoadingError is a ConnectionError. On a cluster: no node serves the slot (yet), or the cluster is down.
# RedisClusterException: no node could be reached to learn the cluster's layout.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, OSError, redis.exceptions.ClusterDownError,
              redis.exceptions.RedisClusterException)
# Error replies that say the server refuses writes for now, whichever they are: hold and retry.
SERVER_STATE = (redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError, redis.exceptions.NoScriptError,
                redis.exceptions.TryAgainError, redis.exceptions.MovedError, redis.exceptions.AskError,
                redis.exceptions.MasterDownError, redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError)
SERVER_STATE_CODES = frozenset({"OOM", "READONLY", "NOSCRIPT", "LOADING", "BUSY", "MISCONF", "NOREPLICAS",
                                "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MOVED", "ASK", "NOPERM", "NOAUTH"})
CHUNK = 256  # outcomes per pipeline round trip
PROBE_PAUSE = 0.2  # seconds between the two tries of a round trip made just after a refused write

__all__ = ["CHUNK", "REDIS_DOWN", "SERVER_STATE", "Outcome", "Refused", "WriteHeld", "Writer", "Written"]


@dataclass
class Written:
    outcome: Outcome
    fresh: bool  # False: the job already had its outcome (a redelivery, or cancelled meanwhile)


class WriteHeld(Exception):
    """Some outcomes got an error reply and stay held, to be retried (the first error is the message)."""


class Refused(Exception):
    """The server dropped the connection on this one write while it answers PING."""


def server_state(e: Exception) -> bool:
    """Whether an error reply says the server refuses writes for now (not this write in particular)."""
    return isinstance(e, SERVER_STATE) or str(e).split(" ", 1)[0] in SERVER_STATE_CODES


class Writer:
    """Filled by the step loop, flushed by one background thread."""

    def __init__(self) -> None:
        self.outbox: deque[Outcome] = deque()
        self._lock = threading.Lock()  # a deque must not change while a chunk is copied out of it
        self._dropped_once: tuple[str, int] | None = None  # the outcome whose write was dropped once

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
        alone = 0  # outcomes at the head to write one per round trip, to find the one the server drops
        try:
            while self.outbox:
                with self._lock:
                    chunk = list(islice(self.outbox, 1 if alone else CHUNK))
                alone = self._round(r, scripts, chunk, now, written, kept) or max(alone - len(chunk), 0)
        finally:
            if kept:
                with self._lock:
                    self.outbox.extendleft(o for o, _ in reversed(kept))
        if kept:
            o, e = kept[0]
            raise WriteHeld(f"{len(kept)} outcomes held, e.g. {o.batch_id}:{o.idx}: {type(e).__name__}: {e}")
        return written

    def _round(self, r: redis.Redis, scripts: Scripts, chunk: list[Outcome], now: float, written: list[Written],
               kept: list[tuple[Outcome, Exception]]) -> int:
        """Write ``chunk`` in one round trip. Returns how many outcomes at the head to write one at a time
        next: the server dropped the connection on one of them while it still answers."""
        replies = _write(scripts, r, chunk, now)
        cut = next((i for i, x in enumerate(replies) if isinstance(x, REDIS_DOWN)), len(chunk))
        self._settle(r, chunk[:cut], replies[:cut], now, written, kept)
        if cut == len(chunk):
            return 0
        dropped = cast(Exception, replies[cut])
        if not _answers(r, chunk[cut].batch_id):
            raise dropped  # down: this outcome and the ones after it stay held
        if len(chunk) - cut > 1:
            return len(chunk) - cut
        o = chunk[cut]
        if self._dropped_once != (o.batch_id, o.idx):
            # Dropped once may be the server restarting under the write (it answers the PING a moment
            # later): write it alone again. Dropped again while the server answers: it is this write.
            self._dropped_once = (o.batch_id, o.idx)
            return 1
        self._dropped_once = None
        why = Refused(f"it dropped the connection on this write twice ({dropped}) while answering PING")
        self._settle(r, chunk[cut:], [why], now, written, kept)
        return 0

    def _settle(self, r: redis.Redis, chunk: list[Outcome], replies: list[object], now: float,
                written: list[Written], kept: list[tuple[Outcome, Exception]]) -> None:
        """Take ``chunk`` off the outbox's head by its replies: written, kept to retry, dropped (batch
        gone) or replaced by a failed outcome. A round trip that fails here (REDIS_DOWN) leaves the
        outcome not yet settled in the outbox, and the stand-ins made so far go in at its head."""
        instead: list[Outcome] = []
        try:
            for o, reply in zip(chunk, replies, strict=True):
                # Asked before the pop: if this round trip fails, ``o`` is still held (CI lost one here).
                gone = isinstance(reply, Exception) and not _asked_twice(batch_exists, r, o.batch_id)
                with self._lock:
                    self.outbox.popleft()
                if not isinstance(reply, Exception):
                    fresh, final = cast(list[Any], reply)
                    written.append(Written(o, bool(fresh)))
                    if final:
                        _retire(r, o.batch_id, now)
                elif gone:  # deleted meanwhile: nothing left to write it to
                    log.warning("dropping the outcome of %s:%s, its batch is gone: %s", o.batch_id, o.idx, reply)
                elif server_state(reply) or o.stands_in:
                    kept.append((o, reply))
                else:
                    log.error("the job server refused the outcome of %s:%s (%d bytes); failing the job: %s",
                              o.batch_id, o.idx, len(o.result_json), reply)
                    instead.append(refused(o, f"{type(reply).__name__}: {reply}"))
        finally:
            if instead:  # written next, in this flush (or the next one)
                with self._lock:
                    self.outbox.extendleft(reversed(instead))


def _write(scripts: Scripts, r: redis.Redis, chunk: list[Outcome], now: float) -> list[object]:
    """One round trip (per node) writing ``chunk``; a reply per outcome, an error as its exception."""
    pipes = NodePipes(r)
    for o in chunk:
        record(scripts, pipes, o, now)
    return pipes.execute()


def _answers(r: redis.Redis, batch_id: str) -> bool:
    """Whether the server of ``batch_id``'s keys answers a PING (on a fresh connection: a dropped one is
    not reused); on a cluster, the node that holds them."""
    try:
        node = r.get_redis_connection(r.get_node_from_key(keys.meta(batch_id))) if is_cluster(r) else r
        return bool(_asked_twice(node.ping))
    except (*REDIS_DOWN, redis.RedisError):
        return False


def _asked_twice(fn: Callable[..., T], *args: Any) -> T:
    """A round trip made just after the server refused or dropped a write (the PING that tells a dropped
    write from an outage, the check that the batch still exists), asked again PROBE_PAUSE later if it fails:
    one failure then is not yet an outage (a pooled connection the server was closing, a loaded machine),
    and taking it for one holds every result behind a reconnect. A second failure is raised."""
    try:
        return fn(*args)
    except REDIS_DOWN as e:
        log.warning("a round trip after a refused write failed (%s: %s); asking again", type(e).__name__, e)
        time.sleep(PROBE_PAUSE)
        return fn(*args)


def _retire(r: redis.Redis, batch_id: str, now: float) -> None:
    try:
        retire_batch(r, batch_id, now)
    except REDIS_DOWN:
        pass  # housekeeping retires final batches left in the open set
    except redis.ResponseError as e:
        log.warning("retiring %s failed (housekeeping retries it): %s", batch_id, e)
