"""The worker loop: pull jobs the KV cache can take -> engine.step() -> write each finished job at once.

One process per accelerator. Besides the loop: claiming the pending jobs of workers whose heartbeat
is gone (and its own, after a restart), dead-lettering jobs delivered too often, aborting cancelled
jobs before the next step, a graceful drain on SIGTERM, and generating on while Redis is away (results
are held and written on reconnect). The Redis protocol is jobs/consumer/commands.py's; the heartbeat
(jobs/consumer/heartbeat.py) and failure isolation (worker/isolation.py) are units of their own.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from jobs import keys
from jobs.consumer import commands as consumer
from jobs.consumer import outcomes
from jobs.consumer.cancel_feed import CancelFeed
from jobs.consumer.commands import CancelEvent, Delivery, Outcome, Pulled
from jobs.consumer.heartbeat import Heartbeat
from jobs.consumer.identity import take_identity
from jobs.consumer.link import Link
from jobs.consumer.outbox import REDIS_DOWN, WriteHeld, Writer
from jobs.housekeeping import RESULTS_TTL, housekeep_if_due
from jobs.store import queue_depth
from worker.convert import completion_to_result, job_to_request
from worker.isolation import EngineSick, Isolation
from worker.metrics import WorkerMetrics
from worker.options import WorkerOptions, WorkerReport
from worker.puller import Puller, default_lookahead
from worker.refusal import fail_waiting_jobs

log = logging.getLogger(__name__)
T = TypeVar("T")

FLUSH_AFTER_GRACE = 10.0  # seconds a stopping worker keeps trying to write held results
DEPTH_EVERY = 2.0  # seconds between queue-depth readings for the metrics
HELD_BACKOFF_MAX = 5.0  # seconds between retries of outcomes that got an error reply


@dataclass
class Held:
    """A job this worker holds (its stream entry is pending under our name until its outcome is written)."""

    d: Delivery
    pulled_at: float
    rid: str | None = None  # the engine request id while it is in the engine

    @property
    def job(self) -> Any:
        return self.d.job


def default_worker_id(llm: Any) -> str:
    device = str(getattr(llm, "device", "cpu")).replace(":", "")
    return f"{socket.gethostname()}/{device}"


@dataclass
class _Timers:
    claim: float = 0.0
    housekeeping: float = 0.0
    depth: float = 0.0
    busy: float = field(default_factory=time.monotonic)


class Worker:
    def __init__(self, llm: Any, opts: WorkerOptions, stop_event: threading.Event | None = None,
                 llm_factory: Callable[[], Any] | None = None) -> None:
        self.llm = llm
        self.llm_factory = llm_factory
        self.o = opts
        self.stop_event = stop_event or threading.Event()
        cfg = getattr(llm, "config", None)
        max_seqs = getattr(cfg, "max_num_seqs", 256)
        self.link = Link(opts.redis_url)
        self.id = take_identity(self.link.r, opts.worker_id or default_worker_id(llm), opts.worker_id is not None,
                                self._beat, opts.heartbeat_ttl)
        lookahead = opts.lookahead if opts.lookahead is not None else default_lookahead(max_seqs)
        self.block_size = getattr(cfg, "block_size", 16)
        self.vocab_size: int | None = getattr(getattr(llm, "hf_config", None), "vocab_size", None)
        self.puller = Puller(opts.queue, self.id, max_seqs, lookahead, self.block_size)
        self.writer = Writer()
        self.metrics = WorkerMetrics(opts.queue, self.id)
        self.report = WorkerReport(worker_id=self.id)
        self.held: dict[str, Held] = {}  # job id -> Held
        self.by_rid: dict[str, Held] = {}  # engine request id -> Held
        self.iso: Isolation[Held] = Isolation()
        self.to_release: list[Held] = []  # aborted at shutdown, not yet handed back to the queue
        self.rids = itertools.count()
        self.t = _Timers()
        self.claim_every = opts.claim_interval or opts.heartbeat_ttl / 2
        self.cancels = CancelFeed(self.link, opts.queue, REDIS_DOWN)
        self.heartbeat = Heartbeat(self.link, self.id, lambda: self._beat(self.id), opts.heartbeat_ttl,
                                   opts.stall_after, REDIS_DOWN)
        self.held_backoff = 0.0
        self.refusing = False  # the last round trip got an error reply
        self._wake = threading.Event()  # outcomes to write
        self._bg_stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.draining = False
        self.drain_deadline = 0.0
        self.started = time.monotonic()
        self._old_signals: dict[int, Any] = {}

    # ---- heartbeat -------------------------------------------------------------------------------
    def _beat(self, wid: str) -> str:
        llm = self.llm
        return json.dumps({
            "id": wid, "host": socket.gethostname(), "pid": os.getpid(), "queue": self.o.queue, "time": time.time(),
            "held": len(getattr(self, "held", ())), "running": llm.num_running, "waiting": llm.num_waiting,
            "free_blocks": llm.num_free_blocks, "total_blocks": llm.num_total_blocks,
            "draining": getattr(self, "draining", False),
        })

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> WorkerReport:
        self._install_signals()
        if self.o.metrics_port is not None:
            self.metrics.serve(self.o.metrics_port)
        log.info("worker %s on queue %r: %s model implementation, %d KV blocks, holds at most %d jobs", self.id,
                 self.o.queue, self.llm.model_impl, self.llm.num_total_blocks, self.puller.max_held)
        # Writing results, cancel news and the heartbeat happen beside the step loop, so a step never
        # waits on Redis, and a long step does not look like a dead worker.
        self.heartbeat.start()
        self.cancels.start()
        t = threading.Thread(target=self._background, name="sluice-writer", daemon=True)
        t.start()
        self._threads.append(t)
        try:
            while not self._finished():
                self._tick()
        finally:
            self._close()
        self.report.wall_s = time.monotonic() - self.started
        if self.report.sick:
            raise EngineSick(self.report.sick)
        return self.report

    def _tick(self) -> None:
        self.heartbeat.tick()
        if self.heartbeat.lapsed.is_set():
            self._redis(self._drop_lost)
        self._apply_cancels()
        if not self.draining:
            self._fill()
        stepped = self._step()
        if len(self.writer):
            self._wake.set()
        self._observe()
        if not stepped:
            self.stop_event.wait(self.o.poll_interval)

    def _background(self) -> None:
        """Write outcomes as they come, and the periodic upkeep; until stopped with nothing left to write."""
        while True:
            self._wake.wait(0.05)
            self._wake.clear()
            stopping = self._bg_stop.is_set()
            try:
                if len(self.writer):
                    self._redis(self._flush)
                if not stopping:
                    self._upkeep(time.monotonic())
            except WriteHeld as e:
                # Redis answered but refused (full, read-only, ...): keep the results and retry.
                self.held_backoff = min(max(2 * self.held_backoff, 0.1), HELD_BACKOFF_MAX)
                self.metrics.write_errors.inc()
                log.error("results held, retrying in %.1fs: %s", self.held_backoff, e)
                self._bg_stop.wait(self.held_backoff)
            except Exception:  # noqa: BLE001 - this thread must not die: results would never be written
                log.exception("background writer")
                time.sleep(0.5)
            if stopping:
                return

    def _apply_cancels(self) -> None:
        for ev in self.cancels.take():
            self._cancel(ev)

    def _redis(self, fn: Callable[..., T], *args: Any) -> T | None:
        """Run a Redis round trip unless Redis is down; note whether it answered."""
        if not self.link.usable():
            return None
        try:
            out = fn(*args)
        except REDIS_DOWN as e:
            self.link.failed(e)
            return None
        except redis.ResponseError as e:
            # Reachable but refusing (full, read-only replica, ...): skip this round trip, try again later.
            if not self.refusing:
                log.error("Redis refused a request (retrying on the next tick): %s", e)
            self.refusing = True
            return None
        self.refusing = False
        if self.link.succeeded():
            self._redis(self.heartbeat.beat_now)
        return out

    def _upkeep(self, now: float) -> None:
        if now >= self.t.housekeeping and not self.draining:
            self.t.housekeeping = now + self.o.housekeeping_interval
            self._redis(lambda: housekeep_if_due(self.link.r, self.id, self.o.housekeeping_interval,
                                                 results_ttl=self.o.results_ttl))
        if now >= self.t.depth:
            self.t.depth = now + DEPTH_EVERY
            depth = self._redis(queue_depth, self.link.r, self.o.queue)
            if depth is not None:
                self.metrics.queue_depth.set(depth)

    def _observe(self) -> None:
        llm = self.llm
        self.metrics.engine(llm.num_running, llm.num_waiting, len(self.held), llm.num_free_blocks,
                            llm.num_total_blocks)
        self.metrics.outbox.set(len(self.writer))
        self.metrics.redis_up.set(1 if self.link.up else 0)
        self.report.max_held = max(self.report.max_held, len(self.held) + len(self.writer))
        if self.held or len(self.writer):
            self.t.busy = time.monotonic()

    # ---- taking jobs -----------------------------------------------------------------------------
    def _fill(self) -> None:
        if self.iso.active:
            if not self.llm.has_unfinished():
                self._next_isolated()
            return
        llm = self.llm
        # Finished jobs stay pending in Redis until their outcome is written: they count as held.
        held = len(self.held) + len(self.writer)
        n = self.puller.budget(held, llm.num_running, llm.num_waiting, llm.num_free_blocks)
        if n <= 0 or (n < self.puller.min_pull and llm.num_waiting > 0):
            return  # the engine has work queued: pull when a few more fit, in one round trip
        for d in self._redis(self._pull, n) or []:
            self._admit(d)

    def _pull(self, n: int) -> list[Delivery]:
        r = self.link.r
        got: list[Delivery] = []
        now = time.monotonic()
        if now >= self.t.claim:
            self.t.claim = now + self.claim_every
            held_entries = {h.d.entry_id for h in self.held.values()} | self.writer.entry_ids()
            claimed = self.puller.claim(r, n, held_entries)
            self.report.claimed += len(claimed.deliveries)
            got = self._unreadable(claimed)
        if len(got) < n:
            got += self._unreadable(self.puller.read(r, n - len(got)))
        return self._screen(got) if got else []

    def _unreadable(self, p: Pulled) -> list[Delivery]:
        """Entries that are not jobs get a failed outcome (their batch can then finish); the jobs are returned."""
        for o in outcomes.unreadables(self.link.r, p, self.id, self.o.queue):
            self.writer.add(o)
        return p.deliveries

    def _screen(self, ds: list[Delivery]) -> list[Delivery]:
        """Settle at once the jobs that must not run (outcome already written, batch cancelled or
        expired, deadline passed, delivered too often); return the rest."""
        now = time.time()
        return [d for d, (done, status, last_error) in zip(ds, consumer.screen(self.link.r, ds), strict=True)
                if self._verdict(d, done, status, last_error, now) is None]

    def _verdict(self, d: Delivery, done: bool, status: str | None, last_error: str | None, now: float) -> str | None:
        """Why ``d`` is not to run (its outcome is queued here), or None."""
        job = d.job
        if status is None:
            return "gone"  # the batch was deleted; its streams with it
        if done or status in ("cancelling", "cancelled"):
            self._settle(d, "cancelled", "batch_cancelled", "the batch was cancelled")
            return "done"
        if status == "expired":
            self._settle(d, "expired", "batch_expired", "the batch expired")
            return "expired"
        if job.deadline is not None and job.deadline <= now:
            self._settle(d, "expired", "deadline_exceeded", "the deadline passed before the job started")
            return "deadline"
        if d.deliveries > self.o.max_deliveries:
            self._dead_letter(d, last_error or "the worker running it stopped without a result (crashed?)")
            return "dead"
        return None

    def _admit(self, d: Delivery) -> None:
        h = Held(d, time.time())
        self.held[d.job.id] = h
        self._start(h)

    def _start(self, h: Held) -> None:
        rid = f"{h.job.id}#{next(self.rids)}"
        try:
            req = job_to_request(h.job, rid, self.vocab_size)
        except ValueError as e:
            self._forget(h)
            self._settle(h.d, "failed", "invalid_request", str(e))
            return
        try:
            self.llm.add_request(req)
        except Exception as e:  # noqa: BLE001 - this job's failure, unless a probe fails too (isolation)
            log.exception("the engine refused job %s", h.job.id)
            self.iso.failed_alone(h, e)
            return
        h.rid = rid
        self.by_rid[rid] = h

    def _next_isolated(self) -> None:
        """With the engine idle: the probe if a job stands accused, else the next suspect alone."""
        probe = self.iso.next_probe()
        if probe is not None:
            try:
                self.llm.add_request(probe)
            except Exception as e:  # noqa: BLE001
                self._sick(e)
            return
        h = self.iso.next_alone()
        if h is not None:
            self._start(h)

    # ---- stepping --------------------------------------------------------------------------------
    def _step(self) -> bool:
        if self.report.sick or not self.llm.has_unfinished():
            return False
        try:
            done = self.llm.step()
        except Exception as e:  # noqa: BLE001
            self._step_failed(e)
            return True
        self.report.steps += 1
        for c in done:
            self._completed(c)
        return True

    def _completed(self, c: Any) -> None:
        if c.request_id == self.iso.probe_rid:
            self._probe_passed()
            return
        h = self.by_rid.pop(c.request_id, None)
        if h is None:
            return  # aborted meanwhile
        self._forget(h)
        # Its KV need, known now without tokenizing the prompt a second time, informs the next pulls.
        p = h.job.params
        self.puller.observe(p.n * -(-(c.usage.prompt_tokens + p.max_tokens) // self.block_size))
        res = completion_to_result(h.job, c, self.llm.tokenizer, started=h.pulled_at, worker=self.id,
                                   model=self.o.queue)
        self.writer.add(Outcome(h.job.batch_id, h.job.idx, res.status, res.model_dump_json(exclude_none=True),
                                h.d.stream, h.d.entry_id))
        self.report.tokens += c.usage.completion_tokens
        self.metrics.job_done(res.status, c.usage.completion_tokens, h.job.created_at, h.pulled_at)

    def _step_failed(self, e: Exception) -> None:
        self.report.step_failures += 1
        if self.iso.probe_rid is not None:
            self._sick(e)
            return
        h = self.iso.alone
        if h is not None:
            log.error("job %s failed the engine step on its own: %s; probing the engine", h.job.id, e)
            self._abort(h)
            self.iso.failed_alone(h, e)
            return
        log.exception("an engine step failed; rerunning its %d jobs one at a time", len(self.by_rid))
        victims = list(self.by_rid.values())
        for h in victims:
            self._abort(h)
        self.iso.step_failed(victims)

    def _probe_passed(self) -> None:
        accused = self.iso.probe_passed()
        if accused is not None and accused.held.job.id in self.held:
            self._attempt_failed(accused.held, accused.error)

    def _sick(self, e: BaseException) -> None:
        """Even our probe fails alone: the engine, not the jobs. Hand every job back uncharged and exit."""
        self.report.sick = f"the engine fails a probe request on its own: {type(e).__name__}: {e}"
        log.error("engine sick, handing back %d jobs and exiting: %s", len(self.held), self.report.sick)
        self.iso.clear()
        self.by_rid.clear()  # no aborts: the engine is not to be trusted with anything more
        self.stop_event.set()
        self._begin_drain(time.monotonic())
        self.drain_deadline = time.monotonic()  # hand back at once; results already made still get written

    def _attempt_failed(self, h: Held, e: BaseException) -> None:
        """This job made a working engine fail: retry it alone, or dead-letter it after max_deliveries."""
        msg = f"{type(e).__name__}: {e}"
        self._redis(consumer.note_error, self.link.r, h.d, msg)
        if h.d.deliveries >= self.o.max_deliveries:
            self._forget(h)
            self._dead_letter(h.d, msg)
            return
        # Counted in Redis too, so the tally survives a crash of this worker; fenced: not if it was taken.
        if self._redis(consumer.count_attempt, self.link.r, self.link.scripts, h.d, self.id) is False:
            self._lose(h)
            return
        h.d.deliveries += 1
        self.iso.retry_first(h)

    def _abort(self, h: Held) -> None:
        if h.rid is None:
            return
        self.by_rid.pop(h.rid, None)
        rid, h.rid = h.rid, None
        try:
            self.llm.abort(rid)
        except Exception:  # noqa: BLE001 - the engine is in an unknown state: start a fresh one
            if self.llm_factory is None:
                raise
            log.exception("abort failed; rebuilding the engine")
            self._rebuild_engine()

    def _rebuild_engine(self) -> None:
        assert self.llm_factory is not None
        survivors = list(self.by_rid.values())
        self.by_rid.clear()
        self.llm = self.llm_factory()
        for h in survivors:
            h.rid = None
        self.iso.step_failed(survivors)

    def _forget(self, h: Held) -> None:
        self.held.pop(h.job.id, None)
        if h.rid is not None:
            self.by_rid.pop(h.rid, None)
        self.iso.discard(h)

    def _lose(self, h: Held) -> None:
        """Another worker took this job while our heartbeat had lapsed: it is theirs now."""
        self._abort(h)
        self._forget(h)
        self.report.lost += 1

    def _drop_lost(self) -> None:
        self.heartbeat.lapsed.clear()
        held = list(self.held.values())
        lost = [h for h, mine in zip(held, consumer.still_held(self.link.r, self.id, [h.d for h in held]), strict=True)
                if not mine]
        for h in lost:
            self._lose(h)
        log.warning("heartbeat had lapsed: %d of %d held jobs were taken by other workers", len(lost), len(held))

    # ---- outcomes --------------------------------------------------------------------------------
    def _settle(self, d: Delivery, status: str, code: str, message: str) -> None:
        self.writer.add(outcomes.settled(d, status, code, message, self.id, self.o.queue))

    def _dead_letter(self, d: Delivery, error: str) -> None:
        log.error("dead-lettering job %s after %d deliveries: %s", d.job.id, d.deliveries, error)
        self.writer.add(outcomes.dead_letter(d, error, self.id, self.o.queue))
        self.report.dead_lettered += 1

    def _flush(self) -> None:
        for w in self.writer.flush(self.link.r, self.link.scripts, time.time()):
            if w.fresh:
                setattr(self.report, w.outcome.status, getattr(self.report, w.outcome.status) + 1)

    # ---- cancels ---------------------------------------------------------------------------------
    def _cancel(self, ev: CancelEvent) -> None:
        hit = [h for h in self.held.values()
               if h.job.batch_id == ev.batch_id and (ev.idx is None or h.job.idx == ev.idx)]
        one = ev.idx is not None
        for h in hit:
            self._abort(h)  # frees its KV blocks before the next step
            self._forget(h)
            code = "batch_expired" if ev.status == "expired" else ("cancelled" if one else "batch_cancelled")
            self._settle(h.d, ev.status, code, f"the {'job' if one else 'batch'} was {ev.status}")
        if hit:
            log.info("aborted %d jobs of %s (%s)", len(hit), ev.batch_id, ev.status)

    # ---- stopping --------------------------------------------------------------------------------
    def _finished(self) -> bool:
        now = time.monotonic()
        idle_for = self.o.exit_when_idle
        if not self.draining and (self.stop_event.is_set() or (idle_for is not None and now - self.t.busy > idle_for)):
            self._begin_drain(now)
        if not self.draining:
            return False
        if self.held and now < self.drain_deadline:
            return False
        if self.held:
            self._release_all()
        if self.to_release:  # retried each tick: Redis may be down, or backing off after a slow reply
            self._redis(self._requeue)
        pending = len(self.writer) or self.to_release
        return not pending or now > self.drain_deadline + FLUSH_AFTER_GRACE

    def _begin_drain(self, now: float) -> None:
        self.draining = True
        self.drain_deadline = now + self.o.grace_period
        log.info("worker %s draining: %d jobs in flight, %.0fs grace", self.id, len(self.held), self.o.grace_period)

    def _release_all(self) -> None:
        """Hand unfinished jobs back to the queue for other workers (not counted as attempts)."""
        left = list(self.held.values())
        for h in left:
            if not self.report.sick:
                self._abort(h)
            self._forget(h)
        self.iso.clear()
        self.to_release += left
        log.info("releasing %d unfinished jobs", len(left))

    def _requeue(self) -> None:
        consumer.requeue(self.link.r, self.link.scripts, [h.d for h in self.to_release], self.id, self.o.queue)
        self.report.released += len(self.to_release)
        self.to_release = []

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            if self.stop_event.is_set():
                self.drain_deadline = 0.0  # a second signal: stop now
            self.stop_event.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_signals[sig] = signal.signal(sig, handler)

    def _close(self) -> None:
        self._bg_stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=FLUSH_AFTER_GRACE)
        self.cancels.stop(FLUSH_AFTER_GRACE)
        self.heartbeat.stop()
        for sig, old in self._old_signals.items():
            signal.signal(sig, old)
        self._redis(consumer.sign_off, self.link.r, self.id)
        self.metrics.close()
        self.link.r.close()


def run_worker(model: str | None = None, *, queue: str | None = None, stop_event: threading.Event | None = None,
               llm: Any = None, worker_id: str | None = None, redis_url: str | None = None,
               lookahead: int | None = None, max_deliveries: int = 3, heartbeat_ttl: float = 10.0,
               claim_interval: float | None = None, grace_period: float = 30.0, metrics_port: int | None = None,
               housekeeping_interval: float = 30.0, results_ttl: float = RESULTS_TTL, poll_interval: float = 0.05,
               exit_when_idle: float | None = None, **engine_kwargs: Any) -> WorkerReport:
    """Serve ``queue`` (default: the model's name, None -> "default") until ``stop_event`` is set or
    SIGTERM/SIGINT (in the main thread) arrives; then drain within ``grace_period`` seconds.

    ``engine_kwargs`` go to ``engine.llm.LLM`` (dtype, max_num_seqs, kv_cache_memory, ...); ``llm``
    passes a ready engine instead. A model the engine refuses (UnsupportedModelError) fails the jobs
    waiting on the queue with the reason, then raises.
    """
    opts = WorkerOptions(
        queue=queue or keys.queue_name(model), worker_id=worker_id, redis_url=redis_url, lookahead=lookahead,
        max_deliveries=max_deliveries, heartbeat_ttl=heartbeat_ttl, claim_interval=claim_interval,
        grace_period=grace_period, metrics_port=metrics_port, housekeeping_interval=housekeeping_interval,
        results_ttl=results_ttl, poll_interval=poll_interval, exit_when_idle=exit_when_idle)
    factory = None
    if llm is None:
        from engine.llm import LLM
        from engine.models.base import UnsupportedModelError

        def factory() -> Any:
            return LLM(model, **engine_kwargs)

        try:
            llm = factory()
        except UnsupportedModelError as e:  # no worker of this model ever will run them: fail its waiting jobs
            fail_waiting_jobs(opts, str(e))
            raise
    return Worker(llm, opts, stop_event, factory).run()
