"""A job the worker holds, from its delivery until its outcome is handed to the session."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.jobs.consumer.commands import Delivery
from sluice.jobs.schemas import Job


@dataclass
class Held:
    """A job this worker holds (its stream entry is pending under our name until its outcome is written)."""

    d: Delivery
    pulled_at: float
    rid: str | None = None  # the engine request id while it is in the engine
    claim_started: float | None = None  # when the read that delivered it began (a trace's sluice.claim)

    @property
    def job(self) -> Job:
        return self.d.job
