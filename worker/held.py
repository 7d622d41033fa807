"""A job the worker holds, from its delivery until its outcome is handed to the session."""

from __future__ import annotations

from dataclasses import dataclass

from sluice.jobs.consumer.commands import Delivery
from sluice.jobs.schemas import Job
from sluice.worker.convert import Parts


@dataclass
class Held:
    """A job this worker holds (its stream entry is pending under our name until its outcome is written)."""

    d: Delivery
    pulled_at: float
    rid: str | None = None  # the engine request id while it is in the engine
    claim_started: float | None = None  # when the read that delivered it began (a trace's sluice.claim)
    parts: Parts | None = None  # its engine requests (several for a list prompt) while it is in the engine

    @property
    def rids(self) -> list[str]:
        return self.parts.rids if self.parts is not None and self.rid is not None else []

    @property
    def job(self) -> Job:
        return self.d.job
