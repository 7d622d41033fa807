"""bench/prefix_plan.py times vLLM's batch by run_batch's own progress bar (its start-up left out)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_prefix_plan", ROOT / "bench" / "prefix_plan.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# As vLLM 0.32's run_batch writes it into the log (tqdm), around its start-up lines.
LOG = """(EngineCore pid=4159) INFO 12-04 21:59:53 [core.py:133] Initializing a V1 LLM engine (v0.32.0) ...
(MainProcess pid=4141) INFO 12-04 22:00:54 [run_batch.py:828] Reading batch from /tmp/x.jsonl...
Running batch:   0% Completed | 0/64 [00:00<?, ?req/s]
Running batch:  91% Completed | 58/64 [00:28<00:02,  2.10req/s]
Running batch: 100% Completed | 64/64 [00:31<00:00,  2.03req/s]
(MainProcess pid=4141) INFO 12-04 22:01:25 [run_batch.py:457] Writing outputs to local file /tmp/y.jsonl
"""


def test_the_batch_time_is_the_progress_bars_last_line() -> None:
    assert bench.vllm_batch_seconds(LOG) == 31


def test_minutes_and_hours_count_and_an_unfinished_bar_gives_none() -> None:
    assert bench.vllm_batch_seconds("Running batch: 100% Completed | 640/640 [02:05<00:00,  5.1req/s]\n") == 125
    assert bench.vllm_batch_seconds("Running batch: 100% Completed | 9/9 [1:02:05<00:00, 0.01req/s]\n") == 3725
    assert bench.vllm_batch_seconds(LOG.replace("100% Completed | 64/64 [00:31", "97% Completed | 62/64 [00:31")) is None
    assert bench.vllm_batch_seconds("") is None
