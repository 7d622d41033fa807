"""Requests whose prompts are slow to render (chat lines with images), held until the scheduler needs them
and then rendered a burst at a time on a thread per core.

Rendering an image line (loading the image, the processor's resize and normalisation) runs in PIL and
numpy, which release the GIL: a burst on two cores takes about half the time of one line after another.
A rendered line holds its processor tensors until its image is encoded (a 5-tile SmolVLM photo: ~16 MB of
float32 pixels), so lines are rendered only a few ahead of the scheduler, not when they arrive: a worker's
whole pull, or a ``generate()`` list of 100,000 lines, would otherwise sit in memory as pixels."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

from sluice.engine.outputs import Request

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Rendering(Generic[T]):
    request: Request
    arrival: float
    result: T | None = None
    error: Exception | None = None  # what rendering raised: the request's own failure, nobody else's


class RenderQueue(Generic[T]):
    def __init__(self, render: Callable[[Request], T], threads: int) -> None:
        self.render = render
        self.threads = threads
        # Rendered lines kept waiting for the scheduler: a step admits a few new sequences (its prompt-token
        # budget over a few hundred tokens each), and each burst should keep every thread busy.
        self.ahead = max(16, 2 * threads)
        self.pending: deque[Rendering[T]] = deque()
        self._ids: set[str] = set()  # of pending: a generate() call may hold 100,000 lines here
        self._pool: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self.pending)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def add(self, request: Request, arrival: float) -> None:
        self.pending.append(Rendering(request, arrival))
        self._ids.add(request.request_id)

    def remove(self, request_id: str) -> Rendering[T] | None:
        if request_id not in self._ids:
            return None
        self._ids.discard(request_id)
        for r in self.pending:
            if r.request.request_id == request_id:
                self.pending.remove(r)
                return r
        return None

    def take(self, waiting: int) -> list[Rendering[T]]:
        """The next requests, rendered, in arrival order: as many as bring ``waiting`` (requests rendered and
        not yet scheduled) up to ``ahead``, and none while it is there."""
        n = min(len(self.pending), self.ahead - waiting)
        if n <= 0:
            return []
        burst = [self.pending.popleft() for _ in range(n)]
        self._ids.difference_update(r.request.request_id for r in burst)
        if self.threads < 2 or n == 1:
            for r in burst:
                self._run(r)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="sluice-render")
            list(self._pool.map(self._run, burst))
        return burst

    def _run(self, r: Rendering[T]) -> None:
        try:
            r.result = self.render(r.request)
        except Exception as e:  # noqa: BLE001 - a request's input (its image, its template) broke it: it fails alone
            if not isinstance(e, ValueError):
                log.exception("rendering request %s failed", r.request.request_id)
            r.error = e

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
