"""How a batch's progress reads in a terminal; the rates themselves are ``sluice.jobs.rates``'s (the dashboard's too)."""

from __future__ import annotations

import time
from datetime import datetime

from sluice.jobs.rates import Rates, duration, rates
from sluice.jobs.schemas import Batch

__all__ = ["Rates", "duration", "rates", "status_text", "when"]


def when(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    return f"{datetime.fromtimestamp(ts):%Y-%m-%d %H:%M:%S} ({duration(max(0.0, now - ts))} ago)"


def status_text(batch: Batch, r: Rates, now: float | None = None) -> str:
    now = now if now is not None else time.time()
    c = batch.counts
    paused = f"  paused since {when(batch.paused_at, now)}" if batch.paused_at is not None else ""
    lines = [f"{batch.id}  {batch.status}{paused}  model {batch.model}",
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
