"""``sluice generate``'s progress bar: requests done, and tokens/s over every token sampled so far.

Counting only finished requests' tokens would read near zero for most of a big batch, whose requests
all finish late. The in-flight count sums over the requests in flight, so it is taken every
``interval`` s."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sluice.engine.llm import LLM
from sluice.engine.outputs import Completion, Request


class Progress:
    def __init__(self, total: int | None, interval: float = 0.5, **tqdm_kwargs: Any) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", desc="generate", **tqdm_kwargs)
        self.interval = interval
        self.start = self.shown = time.monotonic()

    def on_step(self, done: list[Completion], tokens: Callable[[], int]) -> None:
        """LLM.generate's ``on_step``."""
        self.advance(len(done), tokens)

    def advance(self, done: int, tokens: Callable[[], int]) -> None:
        """The runner's (worker/runner.py) step: ``done`` jobs finished in it."""
        if done:
            self.bar.update(done)
        if time.monotonic() - self.shown >= self.interval:
            self.show_rate(tokens())

    def show_rate(self, tokens: int) -> None:
        self.shown = time.monotonic()
        self.bar.set_postfix_str(f"{tokens / max(self.shown - self.start, 1e-9):.0f} tok/s")

    def close(self, tokens: int) -> None:
        self.show_rate(tokens)
        self.bar.close()


def progress_bar(total: int | None) -> Progress:
    return Progress(total)


def generate(llm: LLM, requests: list[Request], progress: bool,
             on_finish: Callable[[Completion], None] | None = None) -> list[Completion]:
    """``llm.generate`` with the bar shown while it runs (when ``progress``)."""
    if not progress:
        return llm.generate(requests, on_finish=on_finish)
    bar = progress_bar(len(requests))
    out = llm.generate(requests, on_finish=on_finish, on_step=bar.on_step)
    bar.close(sum(c.usage.completion_tokens for c in out))
    return out
