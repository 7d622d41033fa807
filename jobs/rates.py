"""How fast a batch goes and when it will be done, from its last few results (never all of them).
``sluice status`` and the API's dashboard both read them here, so both show the same numbers."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sluice.jobs.schemas import Batch, Result


@dataclass
class Rates:
    requests_per_s: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None


def rates(batch: Batch, recent: list[Result], now: float | None = None) -> Rates:
    """Rates over the span of ``recent`` (the batch's last results); while the batch runs the span
    reaches to now, so a stalled batch shows its rates falling rather than frozen."""
    times = [r.timings.finished for r in recent if r.timings.finished]
    if not times:
        return Rates()
    start = min(times)
    end = max(times) if batch.is_final else max(now if now is not None else time.time(), max(times))
    span = end - start
    if span <= 0:
        return Rates()
    rps = (len(times) - 1) / span if len(times) > 1 else None
    tps = sum(r.usage.completion_tokens for r in recent if r.timings.finished and r.timings.finished > start) / span
    left = batch.counts.total - batch.counts.done
    eta = left / rps if rps and not batch.is_final else None
    return Rates(rps, tps, eta)


def duration(seconds: float) -> str:
    """12s, 3m05s, 2h07m: how an ETA or an age reads."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
