"""Adapters loaded when a line names them, through the queue (issue 46, item 2): ``python -m sluice.worker
--lora-root`` on the embedded server serves a batch whose lines name six adapters it was never told about
(over two slots), the base, a missing adapter and names that try to leave the root: each job once, each
adapter's lines as an engine given those adapters up front, the bad ones failed alone; its heartbeat says
which adapters it holds."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import redis
from helpers import fresh_seed, make_tiny_model
from jobs_helpers import assert_exactly_once, finish_with, wait_for, worker_process
from lora_helpers import make_adapter
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.jobs import keys
from sluice.jobs.store import get_batch, list_workers
from sluice.jobs.submit import submit

pytest.importorskip("peft")
pytest_plugins = ["jobs_fixtures"]

ADAPTERS = [f"a{i}" for i in range(6)]
TARGETS = [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj"], ["k_proj", "q_proj"],
           ["v_proj", "up_proj"], ["down_proj"]]
MAX_TOKENS = 6


def test_a_worker_loads_the_adapters_lines_name_from_its_root(r: redis.Redis, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    base = make_tiny_model(tmp_path / "base", seed=0)
    root = tmp_path / "adapters"
    for i, name in enumerate(ADAPTERS):
        make_adapter(base, root / name, seed=i, r=2 * (i + 1), targets=TARGETS[i])
    shutil.copytree(root / "a0", tmp_path / "outside")  # a valid adapter beside the root: never read
    models = ["tiny", *(f"tiny:{a}" for a in ADAPTERS)]
    n = 30
    rows = [(models[rng.randrange(len(models))], [rng.randrange(20, 49152) for _ in range(rng.randint(3, 20))])
            for _ in range(n)]
    rows[0] = ("tiny", rows[0][1])
    bad = {"tiny:missing": "not under the adapter roots", "tiny:..": "not a plain name",
           "tiny:%2e%2e%2foutside": "not a plain name"}
    rows += [(m, [5, 6, 7]) for m in bad]
    lines = [json.dumps({"custom_id": f"job-{i}", "model": m, "prompt": p, "max_tokens": MAX_TOKENS,
                         "ignore_eos": True}) for i, (m, p) in enumerate(rows)]
    b = submit(lines, r=r)
    log = tmp_path / "worker.log"
    p = worker_process(base, "w-dyn", "--lora-root", str(root), "--max-loras", "2", "--max-cpu-loras", "3",
                       "--exit-when-idle", "4", log=log)
    try:
        wait_for(lambda: get_batch(r, b.id).is_final or p.poll() is not None, 600, "the batch to finish")
        assert p.poll() is None, log.read_text()[-3000:]
        beat = wait_for(lambda: next((w for w in list_workers(r) if w.adapters), None), 30, "a heartbeat")
    finally:
        finish_with(r, b.id, p, log, 60)
    assert beat.lora_roots is True and set(beat.adapters) <= set(ADAPTERS)
    assert 1 <= len(beat.adapters) <= 3  # what it holds now: the CPU cache's size at most
    entries = {e["custom_id"]: e for e in assert_exactly_once(r, b.id, len(rows))}
    for i, (model, _) in enumerate(rows[n:], start=n):
        e = entries.pop(f"job-{i}")
        assert e["status"] == "failed" and bad[model] in e["error"]["message"], e
    # Each line ran on its own adapter: the tokens of one engine given those adapters up front.
    ref = LLM(str(base), dtype="float32", kv_cache_memory=4 << 20, lora_modules={a: str(root / a) for a in ADAPTERS})
    want = ref.generate([Request(f"job-{i}", prompt_token_ids=prompt, lora=keys.split_model(m)[1],
                                 params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                         for i, (m, prompt) in enumerate(rows[:n])])
    for i, c in enumerate(want):
        e = entries[f"job-{i}"]
        assert e["status"] == "completed" and e["model"] == rows[i][0]
        assert e["text"] == c.text, (i, rows[i][0])
