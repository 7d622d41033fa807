"""``python -m worker`` whose engine takes at least PACE seconds a step: a test that signals a worker "while it
is still working" holds on any machine, however fast it runs the tiny model (1,000 tokens take 20 s or more).

Usage: ``python tests/paced_worker.py <python -m worker's arguments>``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.llm import LLM  # noqa: E402
from engine.outputs import Completion  # noqa: E402
from worker.__main__ import main  # noqa: E402

PACE = 0.02
_step = LLM.step


def paced_step(self: LLM) -> list[Completion]:
    time.sleep(PACE)
    return _step(self)


if __name__ == "__main__":
    LLM.step = paced_step  # type: ignore[method-assign]
    main(sys.argv[1:])
