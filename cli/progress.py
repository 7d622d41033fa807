"""How fast a batch goes and when it will be done, from its last few results (never all of them)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime

from jobs.schemas import Batch, Result


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
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def when(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    return f"{datetime.fromtimestamp(ts):%Y-%m-%d %H:%M:%S} ({duration(max(0.0, now - ts))} ago)"


def status_text(batch: Batch, r: Rates, now: float | None = None) -> str:
    now = now if now is not None else time.time()
    c = batch.counts
    lines = [f"{batch.id}  {batch.status}  model {batch.model}",
             f"requests: {c.done}/{c.total} done ({c.completed} completed, {c.failed} failed, {c.cancelled} "
             f"cancelled, {c.expired} expired)" + (f"; {c.invalid} bad input lines" if c.invalid else "")]
    speed = []
    if r.requests_per_s is not None:
        speed.append(f"{r.requests_per_s:.2f} requests/s")
    if r.tokens_per_s is not None:
        speed.append(f"{r.tokens_per_s:.1f} tokens/s")
    if r.eta_s is not None:
        speed.append(f"ETA {duration(r.eta_s)}")
    if speed:
        lines.append("speed:    " + ", ".join(speed))
    lines.append(f"created:  {when(batch.created_at, now)}")
    ended = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
    if batch.is_final and ended:
        lines.append(f"{batch.status}: {when(ended, now)}, after {duration(ended - batch.created_at)}")
    return "\n".join(lines)
