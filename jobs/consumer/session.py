"""One worker's seat at a queue: everything a consumer does in Redis, behind a handful of verbs.

``ConsumerSession`` owns the connection (and its Redis-down guard), the worker's identity and
heartbeat, the cancel feed, the outbox and the thread that writes it, the upkeep thread (spills,
housekeeping), the cached list of ready streams, and the screening of what it hands out. The worker (worker/) calls only its verbs and
knows no Redis:

    take(n, held)          jobs to run (orphans claimed when due, new ones read; the ones that must
                           not run are settled here)
    put(d, result)         a finished job's result, written by the writer thread
    settle(d, ...)         an outcome for a job that did not run (cancelled, expired, refused)
    charge(d, error)       a failed attempt: "retry", "dead" (dead-lettered) or "lost" (taken by another)
    sick(ds)               the engine went sick holding these: each runs alone from now on, anywhere
    hand_back(ds)          unfinished jobs back to the queue (a drain); False while Redis is away
    stream(texts)          new text of jobs that stream it (interactive requests)
    cancels()              cancel events that arrived since the last call
    lost(ds)               after our heartbeat lapsed: the deliveries another worker took
    close()                write what is held, sign off
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import redis
from sluice.jobs import interactive, tracing
from sluice.jobs.consumer import commands, outcomes
from sluice.jobs.consumer.cancel_feed import CancelFeed
from sluice.jobs.consumer.commands import CancelEvent, Delivery, Outcome, Pulled
from sluice.jobs.consumer.heartbeat import Heartbeat
from sluice.jobs.consumer.identity import take_identity
from sluice.jobs.consumer.link import Link
from sluice.jobs.consumer.outbox import REDIS_DOWN, WriteHeld, Writer, Written
from sluice.jobs.consumer.outcomes import failed_instead
from sluice.jobs.consumer.upkeep import Upkeep
from sluice.jobs.housekeeping import RESULTS_TTL
from sluice.jobs.schemas import Result, WorkerHeartbeat
from sluice.jobs.settings import DEFAULT_HEARTBEAT_TTL, DEFAULT_MAX_DELIVERIES, job_plane
from sluice.jobs.store import served_queues

log = logging.getLogger(__name__)
T = TypeVar("T")

STREAMS_REFRESH = 1.0  # seconds a queue's list of ready streams is reused
HELD_BACKOFF_MAX = 5.0  # seconds between retries of outcomes that got an error reply
FLUSH_AFTER_GRACE = 10.0  # seconds a closing session waits for its writer thread

# Everything a round trip to the job server may raise: unreachable, refusing, or results held.
JOB_SERVER_ERRORS: tuple[type[BaseException], ...] = (*REDIS_DOWN, redis.RedisError, WriteHeld)
# What connecting may raise besides (the embedded server failing to start).
CONNECT_ERRORS: tuple[type[BaseException], ...] = (OSError, RuntimeError, redis.RedisError)


@dataclass
class SessionSettings:
    """How a session behaves; the worker's options carry them (worker/options.py)."""

    max_deliveries: int = DEFAULT_MAX_DELIVERIES  # a batch's own (Job.max_deliveries) wins
    heartbeat_ttl: float = DEFAULT_HEARTBEAT_TTL
    claim_interval: float | None = None  # default: heartbeat_ttl / 2
    stall_after: float = 600.0  # a step loop stuck this long (a hung engine) lets the heartbeat lapse
    housekeeping_interval: float = 30.0
    results_ttl: float = RESULTS_TTL


@dataclass
class SessionStats:
    """What the session did, for the worker's report. ``written`` counts fresh outcomes by status."""

    claimed: int = 0
    dead_lettered: int = 0
    released: int = 0
    write_errors: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0


class ConsumerSession:
    def __init__(self, queue: str, worker_id: str, explicit_id: bool, redis_url: str | None,
                 settings: SessionSettings, status: Callable[[], dict[str, Any]], register: bool = True) -> None:
        """Connect and take the identity ``worker_id`` (``explicit_id``: that one or fail, else the first
        free of ``worker_id``, ``-2``, ``-3``...). ``status`` is the engine's side of each heartbeat.
        ``register=False``: no identity nor heartbeat (the jobs it takes are claimable if it dies)."""
        self.queue = queue
        self.s = settings
        self.status = status
        self.draining = False  # no housekeeping while draining: it could outlast us
        self.max_result_bytes = job_plane().max_result_bytes
        self.outbox = Writer()
        # Traced jobs handed to the writer: (batch id, idx) -> (traceparent, when) for their write_back span.
        self._traced: dict[tuple[str, int], tuple[str, float]] = {}
        self._traced_lock = threading.Lock()
        self._held: tuple[float, str] | None = None  # since when outcomes are held on error replies, the first
        self.link = Link(redis_url)
        self.id = (take_identity(self.link.r, worker_id, explicit_id, self._beat, settings.heartbeat_ttl)
                   if register else worker_id)
        self.stats = SessionStats()
        self.upkeep = Upkeep(self.link, queue, self.id, self._guard, lambda: self.draining,
                             settings.housekeeping_interval, settings.results_ttl)
        self.cancel_feed = CancelFeed(self.link, queue, REDIS_DOWN)
        self.heartbeat = Heartbeat(self.link, self.id, lambda: self._beat(self.id), settings.heartbeat_ttl,
                                   settings.stall_after, REDIS_DOWN)
        self.claim_every = settings.claim_interval or settings.heartbeat_ttl / 2
        self._claim_at = 0.0
        self._streams: list[tuple[str, float]] = []
        self._streams_at = -math.inf
        self._turn = 0  # reads so far: where the fair share among open batches starts (commands.read)
        # Jobs the last read saw handed to a group's owner and not yet taken: if their owner went quiet
        # (busy, or gone) we take them, so we are not idle (an idle exit would leave them to nobody).
        self.handed = 0
        self._refusing = False  # the last round trip got an error reply
        self._held_backoff = 0.0
        self._wake = threading.Event()  # outcomes to write
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="sluice-writer", daemon=True)
        self._started = False

    def _beat(self, wid: str) -> str:
        """The heartbeat's payload; it says when results wait because the server refuses their writes
        (while it is unreachable there is no heartbeat: it lapses, and our jobs may be taken)."""
        held: dict[str, Any] = {"unwritten": len(self.outbox)}
        if self._held is not None:
            held |= {"writes_held_since": self._held[0], "write_error": self._held[1]}
        beat = WorkerHeartbeat(id=wid, host=socket.gethostname(), pid=os.getpid(), queue=self.queue, time=time.time(),
                               **self.status(), **held)
        return beat.model_dump_json()

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """The heartbeat, the cancel feed, the writer and the upkeep, each on its own thread, so a step
        never waits on Redis, a long step does not look like a dead worker, and a slow disk or a long
        housekeeping pass does not hold up the writes."""
        self._started = True
        self.heartbeat.start()
        self.cancel_feed.start()
        self._writer.start()
        self.upkeep.start()

    def tick(self) -> None:
        """The step loop is alive; write what it finished."""
        self.heartbeat.tick()
        if len(self.outbox):
            self._wake.set()

    def close(self) -> None:
        if self._started:
            self._stop.set()
            self._wake.set()
            self._writer.join(timeout=FLUSH_AFTER_GRACE)
            self.upkeep.stop(FLUSH_AFTER_GRACE)
            self.cancel_feed.stop(FLUSH_AFTER_GRACE)
            self.heartbeat.stop()
            # Gone at once, so other workers may claim what we still held without waiting out the TTL.
            self._guard(commands.sign_off, self.link.r, self.id)
        self.link.r.close()

    @property
    def up(self) -> bool:
        return self.link.up

    @property
    def pending_writes(self) -> int:
        return len(self.outbox)

    @property
    def queue_depth(self) -> int | None:
        return self.upkeep.queue_depth

    # ---- verbs -----------------------------------------------------------------------------------
    def take(self, n: int, held: set[str]) -> list[Delivery]:
        """Up to ``n`` jobs to run: pending jobs of dead workers (every ``claim_interval``; not the
        ``held`` entries, which are ours and running), then new ones. Those that must not run are
        settled here. Nothing while Redis is away."""
        return self._guard(self._take, n, held) or []

    def _take(self, n: int, held: set[str]) -> list[Delivery]:
        got: list[Delivery] = []
        now = time.monotonic()
        if now >= self._claim_at:
            self._claim_at = now + self.claim_every
            claimed = commands.claim(self.link.r, self.queue, self.id, n, held | self.outbox.entry_ids(),
                                     self.link.scripts)
            self.stats.claimed += len(claimed.deliveries)
            got = self._unreadable(claimed)
        if len(got) < n:
            got += self._unreadable(self._read(n - len(got)))
        return self._screen(got) if got else []

    def _read(self, n: int) -> Pulled:
        """New jobs, best-scored ready stream first. The list is reused for a second, but re-read at
        once when it ran dry (new work may have come)."""
        now = time.monotonic()
        if now - self._streams_at > STREAMS_REFRESH or not self._streams:
            self._streams = commands.ready(self.link.r, self.queue)
            self._streams_at = now
        got = commands.read(self.link.r, self.queue, self.id, n, self._streams, self.link.scripts, self._turn)
        self._turn += 1  # the next read starts its fair share at the next open batch
        self.handed = got.handed
        if len(got.deliveries) < n:
            self._streams_at = -math.inf
        return got

    def _unreadable(self, p: Pulled) -> list[Delivery]:
        """Entries that are not jobs get a failed outcome (their batch can then finish); the jobs are returned."""
        for o in outcomes.unreadables(self.link.r, p, self.id, self.queue):
            self.outbox.add(o)
        return p.deliveries

    def _screen(self, ds: list[Delivery]) -> list[Delivery]:
        """Settle at once the jobs that must not run (outcome already written, batch cancelled or
        expired, deadline passed, delivered too often); return the rest."""
        now = time.time()
        return [d for d, (done, status, last_error) in zip(ds, commands.screen(self.link.r, ds), strict=True)
                if self._verdict(d, done, status, last_error, now) is None]

    def _verdict(self, d: Delivery, done: bool, status: str | None, last_error: str | None, now: float) -> str | None:
        """Why ``d`` is not to run (its outcome is queued here), or None."""
        if status is None:
            return "gone"  # the batch was deleted; its streams with it
        if done or status in ("cancelling", "cancelled"):
            self.settle(d, "cancelled", "batch_cancelled", "the batch was cancelled")
            return "done"
        if status == "expired":
            self.settle(d, "expired", "batch_expired", "the batch expired")
            return "expired"
        if d.job.deadline is not None and d.job.deadline <= now:
            self.settle(d, "expired", "deadline_exceeded", "the deadline passed before the job started")
            return "deadline"
        if d.deliveries > self.max_deliveries(d):
            self.dead_letter(d, last_error or "the worker running it stopped without a result (crashed?)")
            return "dead"
        return None

    def take_waiting(self, n: int, seen: set[str]) -> list[Delivery]:
        """Up to ``n`` jobs waiting on the queue, new or pending under dead workers, not in ``seen``
        (their entry ids are added to it), unscreened; not guarded: Redis errors are raised."""
        got = commands.claim(self.link.r, self.queue, self.id, n, seen, self.link.scripts)
        self._streams_at = -math.inf  # the ready streams as they are now
        more = self._read(n)
        got.deliveries += more.deliveries
        got.unreadable += more.unreadable
        seen.update(u.entry_id for u in got.unreadable)
        seen.update(d.entry_id for d in got.deliveries)
        return self._unreadable(got)

    def write_now(self) -> int:
        """Write the outbox in this thread; how many outcomes were fresh. Raises like Writer.flush."""
        written = self.outbox.flush(self.link.r, self.link.scripts, time.time())
        self._trace_written(written)
        return sum(w.fresh for w in written)

    def serves_elsewhere(self) -> bool:
        """Whether a live worker serves this session's queue."""
        return self.queue in served_queues(self.link.r)

    def put(self, d: Delivery, result: Result) -> None:
        """A job's result, to be written (and its stream entry acknowledged) by the writer thread; one
        larger than SLUICE_MAX_RESULT_BYTES fails the job instead (``result_too_large``)."""
        body = result.model_dump_json(exclude_none=True)
        size = len(body) if body.isascii() else len(body.encode())
        if size > self.max_result_bytes:
            log.error("job %s: its result is %d bytes, over SLUICE_MAX_RESULT_BYTES (%d): failing it",
                      d.job.id, size, self.max_result_bytes)
            result = failed_instead(result, "result_too_large", f"the result is {_size(size)}; a job's result "
                                    f"may be at most {_size(self.max_result_bytes)} (SLUICE_MAX_RESULT_BYTES)")
            body = result.model_dump_json(exclude_none=True)
        if d.job.traceparent is not None and tracing.enabled():
            with self._traced_lock:
                self._traced[(d.batch_id, d.job.idx)] = (d.job.traceparent, time.time())
        self.outbox.add(Outcome(d.batch_id, d.job.idx, result.status, body, d.stream, d.entry_id))

    def stream(self, texts: list[tuple[Delivery, int, str]]) -> None:
        """New text of streaming jobs, (delivery, sample index, text) each, appended now in one round trip
        (a step's worth; the final result completes it, so text lost while Redis is away is not fatal)."""
        if texts:
            self._guard(self._append_deltas, texts)

    def _append_deltas(self, texts: list[tuple[Delivery, int, str]]) -> None:
        interactive.append_deltas(self.link.r, self.link.scripts, self.id,
                                  [(d.batch_id, d.deliveries, index, text) for d, index, text in texts])

    def settle(self, d: Delivery, status: str, code: str, message: str) -> None:
        self.outbox.add(outcomes.settled(d, status, code, message, self.id, self.queue))

    def settle_cancelled(self, d: Delivery, ev: CancelEvent) -> None:
        self.settle(d, ev.status, *ev.reason())

    def dead_letter(self, d: Delivery, error: str) -> None:
        log.error("dead-lettering job %s after %d deliveries: %s", d.job.id, d.deliveries, error)
        self.outbox.add(outcomes.dead_letter(d, error, self.id, self.queue))
        self.stats.dead_lettered += 1

    def max_deliveries(self, d: Delivery) -> int:
        """Deliveries ``d`` may have: its batch's own setting, else this worker's."""
        return d.job.max_deliveries or self.s.max_deliveries

    def charge(self, d: Delivery, error: str) -> Literal["retry", "dead", "lost"]:
        """This job made a working engine fail: dead-letter it after ``max_deliveries``, else count the
        attempt in Redis (so the tally survives our crash; fenced: "lost" if another worker has it)."""
        self._guard(commands.note_error, self.link.r, d, error)
        if d.deliveries >= self.max_deliveries(d):
            self.dead_letter(d, error)
            return "dead"
        if self._guard(commands.count_attempt, self.link.r, self.link.scripts, d, self.id) is False:
            return "lost"
        d.deliveries += 1
        return "retry"

    def sick(self, ds: list[Delivery]) -> None:
        """The engine failed even a probe while we held ``ds``: note the episode on each, in Redis, so
        that whichever worker takes one next runs it alone (``Delivery.sick_episodes``). A job that then
        breaks a working engine alone is the culprit, and is charged (``charge``); the rest run on.
        Lost if Redis is away: the jobs are then only handed back, as before."""
        if ds:
            self._guard(commands.note_sick, self.link.r, ds)

    def hand_back(self, ds: list[Delivery]) -> bool:
        """Unfinished jobs back to the queue for other workers, not counted as attempts. False if Redis
        did not answer: call again."""
        done = self._guard(self._requeue, ds) is not None
        if done:
            self.stats.released += len(ds)
        return done

    def _requeue(self, ds: list[Delivery]) -> bool:
        commands.requeue(self.link.r, self.link.scripts, ds, self.id, self.queue)
        return True

    def cancels(self) -> list[CancelEvent]:
        return self.cancel_feed.take()

    def lost(self, ds: list[Delivery]) -> list[Delivery]:
        """After our heartbeat had lapsed: which of ``ds`` other workers took (they are theirs now)."""
        if not self.heartbeat.lapsed.is_set():
            return []
        mine = self._guard(self._still_held, ds)
        if mine is None:
            return []
        lost = [d for d, ok in zip(ds, mine, strict=True) if not ok]
        log.warning("heartbeat had lapsed: %d of %d held jobs were taken by other workers", len(lost), len(ds))
        return lost

    def _still_held(self, ds: list[Delivery]) -> list[bool]:
        self.heartbeat.lapsed.clear()
        return commands.still_held(self.link.r, self.id, ds)

    # ---- the Redis-down guard and the writer thread ----------------------------------------------
    def _guard(self, fn: Callable[..., T], *args: Any) -> T | None:
        """Run a Redis round trip unless Redis is down; note whether it answered (None: it did not)."""
        if not self.link.usable():
            return None
        try:
            out = fn(*args)
        except REDIS_DOWN as e:
            self.link.failed(e)
            return None
        except redis.ResponseError as e:
            # Reachable but refusing (full, read-only replica, ...): skip this round trip, try again later.
            if not self._refusing:
                log.error("Redis refused a request (retrying on the next tick): %s", e)
            self._refusing = True
            return None
        self._refusing = False
        if self.link.succeeded():
            self._guard(self.heartbeat.beat_now)
        return out

    def _write_loop(self) -> None:
        """Write outcomes as they come; until stopped with nothing left to write."""
        while True:
            self._wake.wait(0.05)
            self._wake.clear()
            stopping = self._stop.is_set()
            try:
                if len(self.outbox) and self._guard(self._flush):
                    self._held, self._held_backoff = None, 0.0
            except WriteHeld as e:
                # Redis answered but refuses writes for now (full, read-only, ...): keep the results and retry.
                self._held = self._held or (time.time(), str(e)[:500])
                self._held_backoff = min(max(2 * self._held_backoff, 0.1), HELD_BACKOFF_MAX)
                self.stats.write_errors += 1
                log.error("results held, retrying in %.1fs: %s", self._held_backoff, e)
                self._stop.wait(self._held_backoff)
            except Exception:  # noqa: BLE001 - this thread must not die: results would never be written
                log.exception("background writer")
                time.sleep(0.5)
            if stopping:
                return

    def _flush(self) -> bool:
        written = self.outbox.flush(self.link.r, self.link.scripts, time.time())
        for w in written:
            if w.fresh:
                setattr(self.stats, w.outcome.status, getattr(self.stats, w.outcome.status) + 1)
        self.upkeep.wrote({w.outcome.batch_id for w in written if w.fresh})
        self._trace_written(written)
        return True

    def _trace_written(self, written: list[Written]) -> None:
        """Each traced job's ``sluice.write_back`` span: from ``put`` until its outcome was written."""
        if not self._traced:
            return
        now = time.time()
        for w in written:
            with self._traced_lock:
                traced = self._traced.pop((w.outcome.batch_id, w.outcome.idx), None)
            if traced is not None:
                tracing.record("sluice.write_back", traced[0], traced[1], now,
                               {**tracing.job_attributes(f"{w.outcome.batch_id}:{w.outcome.idx}", w.outcome.batch_id),
                                "sluice.worker": self.id, "sluice.status": w.outcome.status})


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"
