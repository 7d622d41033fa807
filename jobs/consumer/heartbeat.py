"""The worker's heartbeat, from its own thread: a step or a pause longer than the TTL must not let
other workers take the jobs of a live worker. A step loop stalled for ``stall_after`` seconds (a hung
engine) stops it, so a hung worker's jobs are still claimed."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sluice.jobs.consumer import commands as consumer
from sluice.jobs.consumer.background import Background
from sluice.jobs.consumer.link import Link

log = logging.getLogger(__name__)


class Heartbeat(Background):
    def __init__(self, link: Link, worker_id: str, payload: Callable[[], str], ttl: float, stall_after: float,
                 redis_down: tuple[type[BaseException], ...]) -> None:
        super().__init__("sluice-heartbeat")
        self.link = link
        self.worker_id = worker_id
        self.payload = payload
        self.ttl_ms = int(ttl * 1000)
        self.every = ttl / 3
        self.stall_after = stall_after
        self.redis_down = redis_down
        self.lapsed = threading.Event()  # set when we found our heartbeat gone: our jobs may be taken
        self.last_tick = time.monotonic()
        self._stalled = False
        self._full = False  # the server refuses the heartbeat's SET for lack of memory

    def tick(self) -> None:
        """The step loop is alive."""
        self.last_tick = time.monotonic()

    def beat_now(self) -> None:
        result = consumer.beat(self.link.r, self.worker_id, self.payload(), self.ttl_ms)
        if result == "lapsed":
            log.warning("worker %s: our heartbeat had lapsed; other workers may have taken our jobs", self.worker_id)
            self.lapsed.set()
        full = result == "kept"
        if full != self._full:  # said once per episode, not once per beat
            self._full = full
            if full:
                log.warning("the job server is full: the heartbeat is kept alive without its status")
            else:
                log.info("the job server takes the heartbeat's status again")

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            stalled = time.monotonic() - self.last_tick > self.stall_after
            if stalled != self._stalled:
                self._stalled = stalled
                if stalled:
                    log.error("the step loop has not moved for %.0fs: letting the heartbeat lapse", self.stall_after)
            if stalled:
                continue
            try:
                self.beat_now()
            except self.redis_down:
                pass  # the step loop notices the outage and reconnects
            except Exception:  # noqa: BLE001 - this thread must not die: our jobs would be taken
                log.exception("heartbeat")
