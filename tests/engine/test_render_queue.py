"""engine/render_queue.py without a model: bursts in arrival order on the render threads, only up to ``ahead`` past those waiting,
the ids of waiting lines kept current (LLM refuses a second line of a waiting id), and a render that raises
failing that line only."""

from __future__ import annotations

import random
import threading

from helpers import fresh_seed
from sluice.engine.outputs import Request
from sluice.engine.render_queue import RenderQueue
from sluice.engine.sampling_params import SamplingParams


def test_bursts_keep_order_and_ids_and_a_raising_render_fails_its_line_alone() -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    n = rng.randint(40, 80)
    bad = {f"r{i}" for i in rng.sample(range(n), 3)}
    thread_of: dict[str, str] = {}

    def render(r: Request) -> list[int]:
        thread_of[r.request_id] = threading.current_thread().name
        if r.request_id in bad:
            raise RuntimeError(f"broken {r.request_id}")
        return [int(r.request_id[1:])]

    q: RenderQueue[list[int]] = RenderQueue(render, threads=2)
    for i in range(n):
        q.add(Request(f"r{i}", prompt="x", params=SamplingParams()), float(i))
    gone = f"r{rng.randrange(n)}"
    assert gone in q and q.remove(gone) is not None and gone not in q and q.remove(gone) is None, seed
    assert q.take(q.ahead) == [], seed  # enough rendered lines already wait
    taken = []
    while len(q):
        waiting = rng.randrange(q.ahead)
        burst = q.take(waiting)
        assert len(burst) == min(q.ahead - waiting, len(burst) + len(q)), seed
        assert not any(r.request.request_id in q for r in burst), seed
        # A burst of several renders on the pool's threads; a single line is rendered in place.
        names = {thread_of[r.request.request_id] for r in burst}
        if len(burst) > 1:
            assert all(name.startswith("sluice-render") for name in names), (names, seed)
        else:
            assert names <= {threading.current_thread().name}, (names, seed)
        taken += burst
    assert [r.request.request_id for r in taken] == [f"r{i}" for i in range(n) if f"r{i}" != gone], seed
    for r in taken:
        if r.request.request_id in bad:
            assert r.result is None and isinstance(r.error, RuntimeError), (r, seed)
        else:
            assert r.error is None and r.result == [int(r.request.request_id[1:])], (r, seed)
    q.close()
