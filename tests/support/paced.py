"""An engine that steps at most PACE times a second, so a test that acts on it "while it is still working"
(a signal, a kill -9 part-way, a page read mid-batch) holds on any machine, however fast it runs the tiny
model: the batch's progress is bounded by the clock (1,000 tokens take 20 s or more).

In a test's own process: ``PacedLLM``. In a subprocess: ``python tests/support/paced.py sluice.worker --model ...`` runs
``python -m sluice.worker --model ...`` with every engine paced."""

from __future__ import annotations

import runpy
import sys
import time
from typing import Any

from sluice.engine.llm import LLM
from sluice.engine.outputs import Completion

PACE = 50.0  # engine steps a second at the most


class Pace:
    """Waits until 1/PACE s have passed since the last call returned."""

    def __init__(self) -> None:
        self.next = 0.0

    def wait(self) -> None:
        time.sleep(max(0.0, self.next - time.monotonic()))
        self.next = time.monotonic() + 1 / PACE


class PacedLLM(LLM):
    """``LLM`` stepping at most PACE times a second."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.pace = Pace()

    def step(self) -> list[Completion]:
        self.pace.wait()
        return super().step()


def pace_every_engine() -> None:
    """Every LLM in this process paced, whoever builds it (the worker and the CLI import LLM themselves)."""
    step, pace = LLM.step, Pace()

    def paced_step(self: LLM) -> list[Completion]:
        pace.wait()
        return step(self)

    LLM.step = paced_step  # type: ignore[method-assign]


if __name__ == "__main__":
    pace_every_engine()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
