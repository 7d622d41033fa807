"""An engine whose steps a test can hold: while held, the batch makes no progress at all, so a test of
what happens "before the answer comes" (a timeout, a client that leaves) holds on any machine, however
fast it runs the model."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from engine.llm import LLM
from engine.outputs import Completion


class HeldLLM(LLM):
    """``LLM`` whose ``step`` waits while the test holds it, and which records what the worker aborted."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.free = threading.Event()
        self.free.set()
        self.aborted: list[str] = []

    @contextmanager
    def held(self) -> Iterator[None]:
        self.free.clear()
        try:
            yield
        finally:
            self.free.set()

    def step(self) -> list[Completion]:
        self.free.wait()
        return super().step()

    def abort(self, request_id: str) -> Completion | None:
        self.aborted.append(request_id)
        return super().abort(request_id)
