"""The dashboard's rates over time: a small ring of samples per batch that the API keeps in memory.

Each sample is a batch's done count and completion tokens (its meta counters, as ``get_batch`` reads
them) at one moment; a rate is the difference of two samples over their time apart. Samples are taken
when a dashboard request reads the batch, at most one per ``MIN_GAP`` seconds, and the first one is
seeded with the batch's start (nothing done at ``in_progress_at``), so the chart has a segment at
once. A full ring drops every other sample, halving its resolution, so it always spans the whole
time the batch was watched in ``SIZE`` samples. Per API process, lost on restart, at most
``BATCHES`` batches (least recently read dropped first).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from sluice.jobs.schemas import Batch

MIN_GAP = 5.0  # seconds between two samples of one batch: results land in bursts, shorter reads as noise
SIZE = 120  # samples kept per batch
BATCHES = 64  # batches kept


@dataclass(frozen=True)
class Sample:
    t: float
    done: int
    tokens: int


@dataclass(frozen=True)
class Point:
    """The rates between two samples, over the time from ``t0`` to ``t``."""

    t0: float
    t: float
    jobs_per_s: float
    tokens_per_s: float


class RateSamples:
    def __init__(self) -> None:
        self._rings: OrderedDict[str, list[Sample]] = OrderedDict()
        self._lock = threading.Lock()  # the dashboard's routes run in a thread pool

    def observe(self, batch: Batch, now: float) -> list[Point]:
        """Record the batch as read now (unless sampled less than MIN_GAP ago); its rates over time.
        A final batch's last sample is at the time it ended, so its rates do not fall after it."""
        end = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
        t = min(now, end) if batch.is_final and end else now
        s = Sample(t, batch.counts.done, batch.usage.completion_tokens)
        with self._lock:
            ring = self._rings.pop(batch.id, None)
            if ring is None:
                start = batch.in_progress_at or batch.created_at
                ring = [Sample(start, 0, 0)] if start < t else []
            last = ring[-1] if ring else None
            if last is None or t - last.t >= MIN_GAP or (batch.is_final and t > last.t):
                ring.append(s)
            if len(ring) > SIZE:
                # Half the resolution; the latest two samples stay, so the latest rate keeps its span (a final
                # sample that overflowed the ring made the last rate an average over a longer, older span).
                ring = ring[:-2:2] + ring[-2:]
            self._rings[batch.id] = ring
            while len(self._rings) > BATCHES:
                self._rings.popitem(last=False)
            return points(ring)


def points(ring: list[Sample]) -> list[Point]:
    return [Point(a.t, b.t, (b.done - a.done) / (b.t - a.t), (b.tokens - a.tokens) / (b.t - a.t))
            for a, b in zip(ring, ring[1:], strict=False) if b.t > a.t]
