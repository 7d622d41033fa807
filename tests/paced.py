"""Runs a module (``python -m`` style) whose engine takes at least PACE seconds a step, so a test that acts
on a process "while it is still working" (a signal, a kill -9 part-way) holds on any machine, however fast
it runs the tiny model: 1,000 tokens take 20 s or more.

Usage: ``python tests/paced.py worker --model ...`` runs ``python -m worker --model ...`` paced."""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.llm import LLM  # noqa: E402
from engine.outputs import Completion  # noqa: E402

PACE = 0.02
_step = LLM.step


def paced_step(self: LLM) -> list[Completion]:
    time.sleep(PACE)
    return _step(self)


if __name__ == "__main__":
    LLM.step = paced_step  # type: ignore[method-assign]
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
