"""Failure isolation: which job broke an engine step, or is it the engine?

After a step fails, its jobs rerun one at a time. A job that fails alone is accused, and a probe (a
one-token request of our own) then runs alone: if the probe passes, the engine works and the accused
job is charged the attempt (dead-lettered after max_deliveries); if the probe fails too, the engine
is sick, and the worker hands its jobs back and exits.

A request can also break the engine for good (as a CUDA device-side assert does): from then on every
step fails, the probe too. Which of the jobs of the step it broke did it cannot be told in that
worker, so it charges none, and notes the sick episode on each job it held (in Redis, through the
session). A job with a sick episode runs alone wherever it goes next ("wary"), and only on an engine
known to work (a step or a probe succeeded since the last failure; a fresh engine is probed first):
if the probe fails after it, that job broke a working engine alone, the proven culprit, and it is
charged the attempt (dead-lettered after max_deliveries like any other); the others run on.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams

H = TypeVar("H")

PROBE_PROMPT = "ping"


class EngineSick(RuntimeError):
    """The engine fails even a probe request alone: restarting the worker is the cure, not dead letters."""


@dataclass
class Accused(Generic[H]):
    held: H
    error: BaseException
    proven: bool = False  # it ran alone on an engine known to work: if the probe fails, it broke it


def culprit_error(e: BaseException) -> str:
    """The error a proven culprit is charged with (its dead letter's and failed result's message)."""
    return ("the engine failed while running this request alone, and failed a probe request after it: "
            f"the request leaves the engine broken ({type(e).__name__}: {e})")


@dataclass
class Isolation(Generic[H]):
    suspects: deque[H] = field(default_factory=deque)  # jobs of a failed step, to rerun one at a time
    alone: H | None = None  # the suspect now running alone
    accused: Accused[H] | None = None  # failed alone; charged once the probe passes
    probe_rid: str | None = None  # the probe now running
    probes: int = 0
    wary: deque[H] = field(default_factory=deque)  # held during some engine's sick episode: each runs alone
    healthy: bool = False  # a step or a probe succeeded since the last failure
    alone_on_healthy: bool = False  # the job running alone started on an engine known to work
    backing_off: list[tuple[float, H]] = field(default_factory=list)  # (monotonic due time, job) charged jobs wait

    @property
    def active(self) -> bool:
        return bool(self.suspects) or bool(self.wary) or self.alone is not None or self.accused is not None

    def step_ok(self) -> None:
        self.healthy = True

    def step_failed(self, running: list[H]) -> None:
        """A step of several jobs failed: rerun each alone."""
        self.healthy = False
        self.suspects.extend(running)

    def failed_alone(self, h: H, e: BaseException) -> None:
        proven = self.alone is h and self.alone_on_healthy
        if self.alone is h:
            self.alone = None
        self.healthy = False
        self.discard(h)
        self.accused = Accused(h, e, proven)

    def culprit(self) -> Accused[H] | None:
        """When the probe failed too: the job that broke a working engine alone, if that is what happened."""
        return self.accused if self.accused is not None and self.accused.proven else None

    def next_probe(self) -> Request | None:
        """The probe to run now, or None: after an accusation, or before a wary job on an engine not
        known to work."""
        if self.probe_rid is not None:
            return None
        if self.accused is None and (self.healthy or self.suspects or self.alone is not None or not self.wary):
            return None
        self.probes += 1
        self.probe_rid = f"sluice-probe#{self.probes}"
        return Request(self.probe_rid, prompt=PROBE_PROMPT, params=SamplingParams(max_tokens=1, ignore_eos=True))

    def probe_passed(self) -> Accused[H] | None:
        """The probe finished: the engine works, so the accused job broke it."""
        self.probe_rid = None
        self.healthy = True
        accused, self.accused = self.accused, None
        return accused

    def next_alone(self) -> H | None:
        if self.accused is not None or self.alone is not None or self.probe_rid is not None:
            return None
        if self.suspects:
            self.alone = self.suspects.popleft()
        elif self.wary and self.healthy:
            self.alone = self.wary.popleft()
        else:
            return None
        self.alone_on_healthy = self.healthy
        return self.alone

    def retry_first(self, h: H) -> None:
        self.suspects.appendleft(h)

    def retry_after(self, h: H, due: float) -> None:
        """A charged job runs again (alone, first) once ``due`` (time.monotonic) has passed: its backoff."""
        self.backing_off.append((due, h))

    def due(self, now: float) -> None:
        """The jobs whose backoff is over go first in line to run alone."""
        for due, h in [x for x in self.backing_off if x[0] <= now]:
            self.backing_off.remove((due, h))
            self.retry_first(h)

    def discard(self, h: Any) -> None:
        if self.alone is h:
            self.alone = None
        if h in self.suspects:
            self.suspects.remove(h)
        if h in self.wary:
            self.wary.remove(h)
        self.backing_off = [x for x in self.backing_off if x[1] is not h]

    def clear(self) -> None:
        self.suspects.clear()
        self.wary.clear()
        self.backing_off.clear()
        self.alone = None
        self.accused = None
        self.probe_rid = None
