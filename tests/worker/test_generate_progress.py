"""sluice generate's progress bar (worker/progress.py) counts tokens as they are sampled, not only when a request finishes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import sluice.worker.progress as progress_module
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams


class RecordingProgress(progress_module.Progress):
    """The real bar (written to a buffer), redrawn every step, noting what each redraw was given."""

    def __init__(self, total: int) -> None:
        self.out = io.StringIO()
        super().__init__(total, interval=0.0, file=self.out)
        self.shown_rates: list[tuple[int, int]] = []  # (requests done, tokens so far) at each redraw

    def show_rate(self, tokens: int) -> None:
        self.shown_rates.append((self.bar.n, tokens))
        super().show_rate(tokens)


def test_progress_counts_tokens_each_step(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bars: list[RecordingProgress] = []
    monkeypatch.setattr(progress_module, "progress_bar", lambda total: bars.append(RecordingProgress(total)) or bars[-1])
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=16 << 20)
    lengths = [4, 8, 12]
    reqs = [Request(f"r{i}", prompt_token_ids=[100 + i, 200, 300], params=SamplingParams(max_tokens=n, ignore_eos=True))
            for i, n in enumerate(lengths)]
    out = progress_module.generate(llm, reqs, progress=True)
    assert [c.usage.completion_tokens for c in out] == lengths
    # All three prompts are prefilled in the first step, so after step k every request has sampled
    # min(k, its max_tokens) tokens; the bar must show that count, long before the first request ends.
    expected = [(sum(n <= k for n in lengths), sum(min(k, n) for n in lengths)) for k in range(1, max(lengths) + 1)]
    (bar,) = bars
    assert bar.shown_rates == [*expected, (3, sum(lengths))]
    assert bar.shown_rates[0] == (0, 3)
    assert "tok/s" in bar.out.getvalue() and "3/3" in bar.out.getvalue()
