"""Failure isolation: which job broke an engine step, or is it the engine?

After a step fails, its jobs rerun one at a time. A job that fails alone is accused, and a probe (a
one-token request of our own) then runs alone: if the probe passes, the engine works and the accused
job is charged the attempt (dead-lettered after max_deliveries); if the probe fails too, the engine
is sick, no job is charged, and the worker hands its jobs back and exits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from engine.outputs import Request
from engine.sampling_params import SamplingParams

H = TypeVar("H")

PROBE_PROMPT = "ping"


class EngineSick(RuntimeError):
    """The engine fails even a probe request alone: restarting the worker is the cure, not dead letters."""


@dataclass
class Accused(Generic[H]):
    held: H
    error: BaseException


@dataclass
class Isolation(Generic[H]):
    suspects: deque[H] = field(default_factory=deque)  # jobs of a failed step, to rerun one at a time
    alone: H | None = None  # the suspect now running alone
    accused: Accused[H] | None = None  # failed alone; charged once the probe passes
    probe_rid: str | None = None  # the probe now running
    probes: int = 0

    @property
    def active(self) -> bool:
        return bool(self.suspects) or self.alone is not None or self.accused is not None

    def step_failed(self, running: list[H]) -> None:
        """A step of several jobs failed: rerun each alone."""
        self.suspects.extend(running)

    def failed_alone(self, h: H, e: BaseException) -> None:
        if self.alone is h:
            self.alone = None
        self.discard(h)
        self.accused = Accused(h, e)

    def next_probe(self) -> Request | None:
        """The probe to run now (after an accusation), or None."""
        if self.accused is None or self.probe_rid is not None:
            return None
        self.probes += 1
        self.probe_rid = f"sluice-probe#{self.probes}"
        return Request(self.probe_rid, prompt=PROBE_PROMPT, params=SamplingParams(max_tokens=1, ignore_eos=True))

    def probe_passed(self) -> Accused[H] | None:
        """The probe finished: the engine works, so the accused job broke it."""
        self.probe_rid = None
        accused, self.accused = self.accused, None
        return accused

    def next_alone(self) -> H | None:
        if self.accused is not None or self.alone is not None or not self.suspects:
            return None
        self.alone = self.suspects.popleft()
        return self.alone

    def retry_first(self, h: H) -> None:
        self.suspects.appendleft(h)

    def discard(self, h: Any) -> None:
        if self.alone is h:
            self.alone = None
        if h in self.suspects:
            self.suspects.remove(h)

    def clear(self) -> None:
        self.suspects.clear()
        self.alone = None
        self.accused = None
        self.probe_rid = None
