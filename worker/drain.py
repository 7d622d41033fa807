"""Stopping a worker: a graceful drain on SIGTERM/SIGINT (a second signal stops now), idle exit, and
handing unfinished jobs back to the queue uncharged."""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from sluice.jobs.consumer.session import ConsumerSession
from sluice.worker.held import Held
from sluice.worker.isolation import Isolation
from sluice.worker.options import WorkerOptions, WorkerReport

log = logging.getLogger(__name__)

FLUSH_AFTER_GRACE = 10.0  # seconds a stopping worker keeps trying to write held results


class Draining:
    """The Worker's stopping half (a mixin: it shares the Worker's state)."""

    id: str
    o: WorkerOptions
    session: ConsumerSession
    stop_event: threading.Event
    held: dict[str, Held]
    iso: Isolation[Held]
    report: WorkerReport
    draining: bool
    drain_deadline: float
    to_release: list[Held]
    _old_signals: dict[int, Any]
    busy_since: float

    def _abort(self, h: Held) -> None: ...
    def _forget(self, h: Held) -> None: ...  # the Worker's

    def _finished(self) -> bool:
        now = time.monotonic()
        idle_for = self.o.exit_when_idle
        if not self.draining and (self.stop_event.is_set() or (idle_for is not None and now - self.busy_since > idle_for)):
            self._begin_drain(now)
        if not self.draining:
            return False
        # Jobs waiting out a retry backoff are not waited for: they go back at once.
        if len(self.held) > len(self.iso.backing_off) and now < self.drain_deadline:
            return False
        if self.held:
            self._release_all()
        # Retried each tick: Redis may be down, or backing off after a slow reply.
        if self.to_release and self.session.hand_back([h.d for h in self.to_release]):
            self.to_release = []
        pending = self.session.pending_writes or self.to_release
        return not pending or now > self.drain_deadline + FLUSH_AFTER_GRACE

    def _begin_drain(self, now: float) -> None:
        self.draining = self.session.draining = True
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

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            if self.stop_event.is_set():
                self.drain_deadline = 0.0  # a second signal: stop now
            self.stop_event.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old_signals[sig] = signal.signal(sig, handler)
