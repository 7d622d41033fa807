"""A session's periodic work, on a thread of its own: moving results to files, housekeeping, the queue
depth for the metrics.

It used to share the writer's thread, so a results disk whose fsync stalled (8 s, say) or a long
housekeeping pass (8,000 open batches: seconds) stopped every outcome write meanwhile, the worker's
outbox filled and the engine idled. Now the writer only writes; it hands the batches it wrote to here.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import redis
from sluice.jobs.consumer.background import Background
from sluice.jobs.consumer.link import Link
from sluice.jobs.housekeeping import housekeep_if_due
from sluice.jobs.spill import Spill
from sluice.jobs.store import queue_depth

log = logging.getLogger(__name__)
T = TypeVar("T")

DEPTH_EVERY = 2.0  # seconds between queue-depth readings for the metrics
SPILL_EVERY = 1.0  # seconds between looks at batches still owed a spill (a full disk, since freed)

Guard = Callable[..., Any]  # the session's Redis-down guard: guard(fn, *args) -> fn's value or None


class Upkeep(Background):
    def __init__(self, link: Link, queue: str, owner: str, guard: Guard, draining: Callable[[], bool],
                 housekeeping_interval: float, results_ttl: float, spill: Spill | None = None) -> None:
        super().__init__("sluice-upkeep")
        self.link, self.queue, self.owner, self.guard, self.draining = link, queue, owner, guard, draining
        self.housekeeping_interval, self.results_ttl = housekeeping_interval, results_ttl
        # Results move to files once a batch holds too many in Redis (SLUICE_RESULTS_SPILL).
        self.spill = spill if spill is not None else Spill.from_settings()
        self.queue_depth: int | None = None
        self._written: set[str] = set()  # batches written since the last spill pass
        self._lock = threading.Lock()

    def wrote(self, batch_ids: Iterable[str]) -> None:
        """Called by the writer thread: these batches got new results (they may be due a spill)."""
        if self.spill is None:
            return
        with self._lock:
            self._written.update(batch_ids)
        self._wake.set()

    def _run(self) -> None:
        housekeeping_at = depth_at = spill_at = 0.0
        while not self._stop.is_set():
            self._wake.wait(SPILL_EVERY)
            self._wake.clear()
            now = time.monotonic()
            try:
                if self.spill is not None and (self._written or now >= spill_at):
                    spill_at = now + SPILL_EVERY
                    self._spill()
                if not self.draining() and now >= housekeeping_at:
                    housekeeping_at = now + self.housekeeping_interval
                    self.guard(self._housekeep)
                if now >= depth_at:
                    depth_at = now + DEPTH_EVERY
                    self.queue_depth = self.guard(queue_depth, self.link.r, self.queue)
            except Exception:  # noqa: BLE001 - this thread must not die: upkeep would stop for good
                log.exception("upkeep")
                self._stop.wait(0.5)

    def _housekeep(self) -> None:
        housekeep_if_due(self.link.r, self.owner, self.housekeeping_interval, results_ttl=self.results_ttl)

    def _spill(self) -> None:
        assert self.spill is not None
        with self._lock:
            batch_ids, self._written = self._written, set()
        self.guard(self._spill_noting_disk_errors, batch_ids)

    def _spill_noting_disk_errors(self, batch_ids: set[str]) -> None:
        """Inside the guard, which counts an OSError as Redis being down: a disk's errors are told apart
        here. The results stay in Redis meanwhile, and the batches stay owed (jobs/spill.py)."""
        assert self.spill is not None
        try:
            self.spill.after_write(self.link.r, self.link.scripts, batch_ids)
        except OSError as e:
            if isinstance(e, redis.RedisError):
                raise
            log.warning("moving results to %s failed (retried in %.0fs): %s", self.spill.files_dir,
                        self.spill.backoff, e)
