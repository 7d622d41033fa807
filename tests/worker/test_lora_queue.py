"""LoRA adapters through the queue (issue 27): a batch whose lines name four adapters of one base (and the
base), served by two workers started with those adapters: each job once, each on its own adapter."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import fresh_seed, make_tiny_model
from jobs_helpers import ThreadWorker, assert_exactly_once, wait_for
from lora_helpers import make_adapter
from sluice.api.app import list_models
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.jobs import keys
from sluice.jobs.store import get_batch, list_workers
from sluice.jobs.submit import submit

pytest.importorskip("peft")
pytest_plugins = ["jobs_fixtures"]

ADAPTERS = ["a0", "a1", "a2", "a3"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("lora-queue")
    base = make_tiny_model(root / "base", seed=0)
    targets = [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj"], ["k_proj", "q_proj"]]
    adapters = {name: str(make_adapter(base, root / name, seed=i, r=4 * (i + 1), targets=targets[i]))
                for i, name in enumerate(ADAPTERS)}
    return base, adapters


def _engine(base: Path, adapters: dict[str, str]) -> LLM:
    return LLM(str(base), dtype="float32", max_num_seqs=8, kv_cache_memory=4 << 20, lora_modules=adapters)


def test_split_model_and_queue_name() -> None:
    assert keys.split_model("tiny:a0") == ("tiny", "a0")
    assert keys.split_model("tiny") == ("tiny", None)
    assert keys.split_model("C:\\models\\m") == ("C:\\models\\m", None)  # a drive letter, not an adapter
    assert keys.split_model("/m/x:y/z") == ("/m/x:y/z", None)
    assert keys.queue_name("tiny:a0") == keys.queue_name("tiny") == "tiny"
    assert keys.queue_name("default:a0") == "default"
    assert keys.parse_lora_module("sql=/p/a") == ("sql", "/p/a")
    for bad in ["sql", "=p", "a:b=p", "sql="]:
        with pytest.raises(ValueError):
            keys.parse_lora_module(bad)


def test_a_batch_over_four_adapters_two_workers_exactly_once(r: redis.Redis,
                                                             base_and_adapters: tuple[Path, dict[str, str]]) -> None:
    base, adapters = base_and_adapters
    rng = random.Random(fresh_seed())
    models: list[str] = ["tiny", *(f"tiny:{a}" for a in ADAPTERS)]
    n = 40
    rows = [(models[rng.randrange(len(models))], [rng.randrange(20, 49152) for _ in range(rng.randint(3, 20))])
            for _ in range(n)]
    rows[0] = ("tiny:a0", rows[0][1])  # the first line picks the batch's queue: the base's, for an adapter too
    rows.append(("tiny:nope", [5, 6, 7]))  # an adapter no worker serves: that line fails, alone
    lines = [json.dumps({"custom_id": f"job-{i}", "model": m, "prompt": p, "max_tokens": MAX_TOKENS,
                         "ignore_eos": True}) for i, (m, p) in enumerate(rows)]
    b = submit(lines, r=r)
    assert get_batch(r, b.id).model == "tiny"
    llms = [_engine(base, adapters) for _ in range(2)]  # both loaded before either pulls
    workers = [ThreadWorker(llm, worker_id=f"w{i}") for i, llm in enumerate(llms)]
    wait_for(lambda: (x := get_batch(r, b.id)) is not None and x.is_final, 600, "the batch to finish")
    beats = list_workers(r)
    models_listed = list_models(_State(r))["data"]
    reports = [w.join() for w in workers]
    entries = assert_exactly_once(r, b.id, n + 1)
    assert sum(rep.completed + rep.failed for rep in reports) == n + 1
    assert all(sorted(w.adapters) == ADAPTERS for w in beats)
    ids = {m["id"]: m.get("parent") for m in models_listed}
    assert ids == {"tiny": None, **{f"tiny:{a}": "tiny" for a in ADAPTERS}}
    # Each line ran on its own adapter: the same tokens as one engine given that request alone.
    ref = _engine(base, adapters)
    by_id = {e["custom_id"]: e for e in entries}
    bad = by_id.pop(f"job-{n}")
    assert bad["status"] == "failed" and "unknown LoRA adapter 'nope'" in bad["error"]["message"]
    want = ref.generate([Request(f"job-{i}", prompt_token_ids=p, lora=keys.split_model(m)[1],
                                 params=SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
                         for i, (m, p) in enumerate(rows[:n])])
    for i, c in enumerate(want):
        e = by_id[f"job-{i}"]
        assert e["status"] == "completed" and e["model"] == rows[i][0]
        assert e["text"] == c.text, (i, rows[i][0])
    assert len(Counter(e["worker"] for e in by_id.values())) == 2, "one worker took every job"


class _State:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def redis(self) -> Any:
        return self.r
