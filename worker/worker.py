"""The worker loop: take jobs the KV cache can take -> engine.step() -> hand each finished job to the
session at once.

One process per accelerator. This is the engine side: the admission budget (worker/puller.py),
stepping, failure isolation (worker/isolation.py), aborting cancelled jobs before the next step, a
graceful drain on SIGTERM. Everything in Redis (taking, holding, writing back, the heartbeat, the
cancel feed, generating on while Redis is away) is the ConsumerSession's (jobs/consumer/session.py).
"""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import threading
import time
from typing import Any

from sluice.engine.embedding_engine import EmbeddingOutput
from sluice.engine.outputs import Completion
from sluice.engine.protocol import Engine
from sluice.jobs.consumer.session import ConsumerSession
from sluice.jobs.settings import retry_backoff
from sluice.worker.convert import Parts
from sluice.worker.drain import Draining
from sluice.worker.held import Held
from sluice.worker.isolation import EngineSick, Isolation, culprit_error
from sluice.worker.kinds import GENERATION, engine_request, engine_result, probe_request, serves
from sluice.worker.lora import adapter_names, job_adapter, loads_adapters
from sluice.worker.metrics import WorkerMetrics
from sluice.worker.options import EngineFactory, WorkerOptions, WorkerReport
from sluice.worker.puller import Puller, default_lookahead
from sluice.worker.streaming import TextStreams
from sluice.worker.tracing import job_finished

log = logging.getLogger(__name__)

def default_worker_id(llm: Engine) -> str:
    return f"{socket.gethostname()}/{str(llm.device).replace(':', '')}"


class Worker(Draining):
    def __init__(self, llm: Engine, opts: WorkerOptions, stop_event: threading.Event | None = None,
                 llm_factory: EngineFactory | None = None) -> None:
        self.llm = llm
        self.llm_factory = llm_factory
        self.o = opts
        self.stop_event = stop_event or threading.Event()
        self.held: dict[str, Held] = {}  # job id -> Held
        self.by_rid: dict[str, Held] = {}  # engine request id -> Held
        self.draining = False
        self.session = ConsumerSession(opts.queue, opts.worker_id or default_worker_id(llm), opts.worker_id is not None,
                                       opts.redis_url, opts.session, self._status)
        self.id = self.session.id
        max_seqs = llm.config.max_num_seqs
        lookahead = opts.lookahead if opts.lookahead is not None else default_lookahead(max_seqs)
        self.block_size = llm.config.block_size
        self.puller = Puller(max_seqs, lookahead, self.block_size)
        self.metrics = WorkerMetrics(opts.queue, self.id)
        self.report = WorkerReport(worker_id=self.id)
        self.iso: Isolation[Held] = Isolation()
        self.to_release: list[Held] = []  # aborted at shutdown, not yet handed back to the queue
        self.rids = itertools.count()
        self.busy_since = time.monotonic()  # last time it held anything (idle exit)
        self.drain_deadline = 0.0
        self.started = time.monotonic()
        self._old_signals: dict[int, Any] = {}
        self.text_streams = TextStreams(llm.tokenizer)  # streaming jobs' text, published after each step

    def _status(self) -> dict[str, Any]:
        """The engine's side of our heartbeat."""
        llm = self.llm
        return {"held": len(self.held), "running": llm.num_running, "waiting": llm.num_waiting,
                "free_blocks": llm.num_free_blocks, "total_blocks": llm.num_total_blocks, "draining": self.draining,
                "serves": serves(llm), "quantization": llm.quantization,
                "adapters": adapter_names(llm), "lora_roots": loads_adapters(llm), "parallelism": llm.parallelism,
                **_prompt_cache(llm)}

    # ---- the loop --------------------------------------------------------------------------------
    def run(self) -> WorkerReport:
        self._install_signals()
        if self.o.metrics_port is not None:
            self.metrics.serve(self.o.metrics_port)
        log.info("worker %s on queue %r: %s model implementation, quantization %s, %s, %d KV blocks, holds at "
                 "most %d jobs", self.id, self.o.queue, self.llm.model_impl, self.llm.quantization, self.llm.parallelism,
                 self.llm.num_total_blocks, self.puller.max_held)
        self.session.start()
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
        for d in self.session.lost([h.d for h in self.held.values()]):
            self._lose(self.held[d.job.id])
        self._apply_cancels()
        if not self.draining:
            self._fill()
        stepped = self._step()
        self.session.tick()
        self._observe()
        if not stepped:
            self.stop_event.wait(self.o.poll_interval)

    def _observe(self) -> None:
        s = self.session
        self.metrics.observe(self.llm, len(self.held), s.pending_writes, s.up, s.queue_depth, s.stats.write_errors)
        self.report.max_held = max(self.report.max_held, len(self.held) + s.pending_writes)
        if self.held or s.pending_writes or s.handed:
            self.busy_since = time.monotonic()

    # ---- taking jobs -----------------------------------------------------------------------------
    def _fill(self) -> None:
        if self.iso.backing_off:
            self.iso.due(time.monotonic())
        if self.iso.active:
            if not self.llm.has_unfinished():
                self._next_isolated()
            return
        llm = self.llm
        # Finished jobs stay pending in Redis until their outcome is written: they count as held.
        held = len(self.held) + self.session.pending_writes
        n = self.puller.budget(held, llm.num_running, llm.num_waiting, llm.num_free_blocks)
        if n <= 0 or (n < self.puller.min_pull and llm.num_waiting > 0):
            return  # the engine has work queued: pull when a few more fit, in one round trip
        claim_started = time.time()
        for d in self.session.take(n, {h.d.entry_id for h in self.held.values()}):
            h = Held(d, time.time(), claim_started=claim_started)
            self.held[d.job.id] = h
            if d.sick_episodes:
                self.iso.wary.append(h)  # held when an engine went sick: it runs alone (worker/isolation.py)
            else:
                self._start(h)

    def _start(self, h: Held) -> None:
        rid = f"{h.job.id}#{next(self.rids)}"
        parts = Parts.of(h.job, rid)  # a list prompt runs as one engine request per prompt
        try:
            reqs = [engine_request(j, r, self.llm) for j, r in zip(parts.jobs, parts.rids, strict=True)]
        except ValueError as e:
            self._forget(h)
            self.session.settle(h.d, "failed", "invalid_request", str(e))
            return
        added: list[str] = []
        try:
            for req in reqs:
                self.llm.add_request(req)  # type: ignore[arg-type]  # an EmbeddingRequest for an EmbeddingEngine
                added.append(req.request_id)
        except Exception as e:  # noqa: BLE001 - this job's failure, unless a probe fails too (isolation)
            log.exception("the engine refused job %s", h.job.id)
            for r in added:  # the job's other prompts leave with it
                self.llm.abort(r)
            self.iso.failed_alone(h, e)
            return
        h.rid, h.parts = rid, parts
        for r in parts.rids:
            self.by_rid[r] = h
            if h.job.stream:
                self.text_streams.add(r, h.d, parts.first_index(r))

    def _next_isolated(self) -> None:
        """With the engine idle: the probe if a job stands accused, else the next suspect alone."""
        probe = self.iso.next_probe()
        if probe is not None:
            try:
                self.llm.add_request(probe_request(probe, self.llm))  # type: ignore[arg-type]
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
        self.iso.step_ok()
        for c in done:
            self._completed(c)
        if self.text_streams:
            self.session.stream(self.text_streams.step(self.llm))
        return True

    def _completed(self, c: Completion | EmbeddingOutput) -> None:
        if c.request_id == self.iso.probe_rid:
            accused = self.iso.probe_passed()  # the engine works, so the accused job broke it
            if accused is not None and accused.held.job.id in self.held:
                self._attempt_failed(accused.held, accused.error)
            return
        h = self.by_rid.pop(c.request_id, None)
        if h is None or h.parts is None:
            return  # aborted meanwhile
        part = h.parts.jobs[h.parts.rids.index(c.request_id)]
        res = h.parts.add(c.request_id, engine_result(part, c, self.llm, started=h.pulled_at, worker=self.id,
                                                      model=self.o.queue))
        if res is None:
            return  # the job's other prompts are still running
        self._forget(h)
        # Its KV need (an embedding's: its tokens), known now without tokenizing the prompt a second
        # time, informs the next pulls.
        p, u = h.job.params, res.usage
        new = p.max_tokens if serves(self.llm) == GENERATION else 0
        self.puller.observe(p.n * -(-(u.prompt_tokens + new) // self.block_size))
        job_finished(h, c, self.id)  # its trace's worker spans (tracing on)
        self.session.put(h.d, res)
        self.report.tokens += u.completion_tokens
        self.metrics.job_done(res.status, u.completion_tokens, h.job.created_at, h.pulled_at,
                              job_adapter(h.job.model, self.llm))

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
        victims = self._in_engine()
        log.exception("an engine step failed; rerunning its %d jobs one at a time", len(victims))
        for h in victims:
            self._abort(h)
        self.iso.step_failed(victims)

    def _sick(self, e: BaseException) -> None:
        """Even our probe fails alone: the engine is broken. Hand every job back and exit, each noted as
        held in a sick episode; only a job that broke a working engine alone is charged."""
        self.report.sick = f"the engine fails a probe request on its own: {type(e).__name__}: {e}"
        log.error("engine sick, handing back %d jobs and exiting: %s", len(self.held), self.report.sick)
        culprit = self.iso.culprit()
        self.session.sick([h.d for h in self.held.values()])
        if culprit is not None and culprit.held.job.id in self.held:
            log.error("job %s broke a working engine alone: charged", culprit.held.job.id)
            if self.session.charge(culprit.held.d, culprit_error(culprit.error)) != "retry":
                self._forget(culprit.held)  # dead-lettered, or another worker's now
        self.iso.clear()
        self.by_rid.clear()  # no aborts: the engine is not to be trusted with anything more
        self.stop_event.set()
        self._begin_drain(time.monotonic())
        self.drain_deadline = time.monotonic()  # hand back at once; results already made still get written

    def _attempt_failed(self, h: Held, e: BaseException) -> None:
        """This job made a working engine fail: retry it alone after its backoff (held meanwhile, so no
        other worker gets it sooner), or dead-letter it after max_deliveries."""
        verdict = self.session.charge(h.d, f"{type(e).__name__}: {e}")
        if verdict == "dead":
            self._forget(h)
        elif verdict == "lost":
            self._lose(h)
        else:
            wait = retry_backoff(h.d.deliveries - 1)
            log.info("job %s failed attempt %d; retrying in %.0fs", h.job.id, h.d.deliveries - 1, wait)
            self.iso.retry_after(h, time.monotonic() + wait)

    def _abort(self, h: Held) -> None:
        if h.rid is None:
            return
        rids = h.rids
        for r in rids:
            self.by_rid.pop(r, None)
            self.text_streams.discard(r)
        h.rid = None
        try:
            for r in rids:
                self.llm.abort(r)
        except Exception:  # noqa: BLE001 - the engine is in an unknown state: start a fresh one
            if self.llm_factory is None:
                raise
            log.exception("abort failed; rebuilding the engine")
            survivors = self._in_engine()
            self.by_rid.clear()
            self.llm = self.llm_factory()
            for s in survivors:
                s.rid = None
            self.iso.step_failed(survivors)

    def _in_engine(self) -> list[Held]:
        """The jobs in the engine, each once (a list prompt's job has a request per prompt)."""
        return list({id(h): h for h in self.by_rid.values()}.values())

    def _forget(self, h: Held) -> None:
        self.held.pop(h.job.id, None)
        for r in h.rids:
            self.text_streams.discard(r)
            self.by_rid.pop(r, None)
        self.iso.discard(h)

    def _lose(self, h: Held) -> None:
        """Another worker took this job while our heartbeat had lapsed: it is theirs now."""
        self._abort(h)
        self._forget(h)
        self.report.lost += 1

    def _apply_cancels(self) -> None:
        for ev in self.session.cancels():
            hit = [h for h in self.held.values()
                   if h.job.batch_id == ev.batch_id and (ev.idx is None or h.job.idx == ev.idx)]
            for h in hit:
                self._abort(h)  # frees its KV blocks before the next step
                self._forget(h)
                if ev.status != "paused":
                    self.session.settle_cancelled(h.d, ev)
            if ev.status == "paused":  # `sluice pause --now`: back to the queue, not counted as a delivery
                self.to_release += hit
            if hit:
                log.info("aborted %d jobs of %s (%s)", len(hit), ev.batch_id, ev.status)
        if self.to_release and not self.draining and self.session.hand_back([h.d for h in self.to_release]):
            self.to_release = []  # else retried on the next tick (Redis away) or by the drain

    def _close(self) -> None:
        self.session.close()
        for sig, old in self._old_signals.items():
            signal.signal(sig, old)
        self.metrics.close()
        self.report.merge(self.session.stats)


def _prompt_cache(llm: Any) -> dict[str, int]:
    """Prompt tokens this worker was asked for and those its prefix cache served (since it started)."""
    stats = llm.stats
    return {"prompt_tokens": int(stats.get("prompt_tokens", 0)), "cached_tokens": int(stats.get("prefix_cache_hit_tokens", 0))}
