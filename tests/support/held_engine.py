"""An engine whose steps a test can hold: while held, the batch makes no progress at all, so a test of
what happens "before the answer comes" (a timeout, a client that leaves) or "part-way through the batch"
(a server killed, a cancel, a stop) holds on any machine, however fast it runs the model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sluice.engine.llm import LLM
from sluice.engine.outputs import Completion


class HeldLLM(LLM):
    """``LLM`` whose ``step`` waits while the test holds it, and which records what the worker aborted.
    ``hold_when(cond)``: the engine holds itself after the first step at whose end ``cond()`` is true
    (say, 40 requests completed), until ``release()``."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.free = threading.Event()
        self.free.set()
        self.aborted: list[str] = []
        self.completed = 0  # requests completed by this engine's steps
        self._hold_cond: Callable[[], bool] | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        self.free.clear()
        try:
            yield
        finally:
            self.free.set()

    def hold_when(self, cond: Callable[[], bool]) -> None:
        self._hold_cond = cond

    @property
    def is_held(self) -> bool:
        return not self.free.is_set()

    def release(self) -> None:
        self._hold_cond = None
        self.free.set()

    def step(self) -> list[Completion]:
        self.free.wait()
        out = super().step()
        self.completed += len(out)
        if self._hold_cond is not None and self._hold_cond():
            self._hold_cond = None
            self.free.clear()
        return out

    def abort(self, request_id: str) -> Completion | None:
        self.aborted.append(request_id)
        return super().abort(request_id)
