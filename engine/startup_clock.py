"""Where an engine's start-up went: one line in the log, so a slow start names its phase
(bench/startup.py reads it back)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

LINE_PREFIX = "start-up in"  # what bench/startup.py looks for


@dataclass
class StartupClock:
    started: float = field(default_factory=time.perf_counter)
    last: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)

    def lap(self, phase: str) -> float:
        """The time since the previous lap (or the start) goes to ``phase`` (a phase lapped twice adds up);
        returns that time."""
        now = time.perf_counter()
        seconds = now - (self.last or self.started)
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self.last = now
        return seconds

    @property
    def total(self) -> float:
        return (self.last or self.started) - self.started

    def line(self) -> str:
        parts = ", ".join(f"{name} {seconds:.2f}" for name, seconds in self.phases.items())
        return f"{LINE_PREFIX} {self.total:.2f} s: {parts}"


def parse_line(text: str) -> dict[str, float] | None:
    """The phases (and ``total``) of a ``line()`` found in ``text``, or None."""
    for row in text.splitlines():
        at = row.find(LINE_PREFIX)
        if at < 0:
            continue
        head, _, rest = row[at + len(LINE_PREFIX):].partition(" s: ")
        out = {"total": float(head)}
        for part in rest.split(", "):
            name, _, seconds = part.rpartition(" ")
            if name:
                out[name] = float(seconds)
        return out
    return None
