"""LoRA adapters and their dependency (issue 40): a worker started with --lora where peft cannot be
imported stops at once with one line, leaving its queue's jobs to a worker that can; past that check, a
missing peft fails each adapter's requests with that line, read once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from helpers import make_tiny_model
from lora_helpers import make_adapter
from sluice.engine.lora.adapters import LoraError
from sluice.engine.lora.cache import AdapterCache
from sluice.jobs import keys
from sluice.jobs.store import get_batch
from sluice.jobs.submit import submit

pytest.importorskip("peft")
pytest_plugins = ["jobs_fixtures"]

NO_PEFT = "import sys; sys.modules['peft'] = None\n"  # `import peft` raises ImportError from here on


@pytest.fixture(scope="module")
def base_and_adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("lora-files")
    base = make_tiny_model(root / "base", seed=0)
    one = make_adapter(base, root / "one", seed=1, r=8, targets=["q_proj", "v_proj", "down_proj"], std=0.5)
    return base, one


def test_a_worker_with_lora_and_no_peft_stops_at_once_with_one_line(
        r: redis.Redis, base_and_adapters: tuple[Path, Path], tmp_path: Path) -> None:
    """``python -m sluice.worker --lora`` where peft cannot be imported: exit 1 before the model loads, one
    line naming peft and how to install it, no traceback, and no job of its queue taken (they wait for a
    worker that can run them)."""
    base, one = base_and_adapters
    lines = [json.dumps({"custom_id": f"j{i}", "model": "tiny:a" if i % 2 else "tiny", "prompt_token_ids": [5, 6, i],
                         "max_tokens": 3, "ignore_eos": True}) for i in range(6)]
    b = submit(lines, r=r, model="tiny")
    args = ["--model", str(base), "--queue", "tiny", "--dtype", "float32", "--worker-id", "nopeft",
            "--heartbeat-ttl", "2", "--lora", f"a={one}"]
    code = NO_PEFT + f"import runpy; sys.argv = ['sluice.worker', *{args!r}]; runpy.run_module('sluice.worker', run_name='__main__')"
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    said = [line for line in p.stderr.splitlines() if "peft" in line]
    assert len(said) == 1 and "LoRA adapters need peft" in said[0] and "pip install 'sluice-llm[lora]'" in said[0], p.stderr
    batch = get_batch(r, b.id)
    assert batch.counts.completed + batch.counts.failed == 0
    assert r.xpending(keys.jobs(b.id, 0), keys.GROUP)["pending"] == 0  # nothing delivered, nothing held


def test_no_peft_fails_each_adapter_once_with_one_line(base_and_adapters: tuple[Path, Path],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the start-up check (peft gone meanwhile): an adapter's requests fail with the same one line,
    from a LoraError (a request's error), read once; never an ImportError (an engine fault)."""
    from sluice.engine.lora.adapters import Target

    _, one = base_and_adapters
    import torch

    cache = AdapterCache({"a": str(one)}, 2, {"q": Target(8, 8)}, 64, torch.device("cpu"), torch.float32)
    monkeypatch.setitem(sys.modules, "peft", None)
    for _ in range(2):
        with pytest.raises(LoraError, match=r"^LoRA adapters need peft, .*pip install 'sluice-llm\[lora\]'$"):
            cache.check("a")
    assert cache.num_loads == 0 and "a" in cache.errors


_REWRITE = """
import json, sys
from pathlib import Path
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams

base, served, other = sys.argv[1:4]
llm = LLM(base, dtype="float32", kv_cache_memory=16 << 20, lora_modules={"a": served, "b": other})
def run(*names):
    reqs = [Request(n, prompt_token_ids=[5, 6, 7, 8], params=SamplingParams(max_tokens=8, ignore_eos=True), lora=n)
            for n in names]
    return llm.generate(reqs)[0].outputs[0].token_ids
first = run("a")
# The served adapter's file rewritten in place: another adapter's bytes, then cut short. The next step
# that takes a with b stacks their weights afresh, from what a holds.
f = Path(served) / "adapter_model.safetensors"
data = (Path(other) / "adapter_model.safetensors").read_bytes()
with open(f, "r+b") as out:
    out.write(data)
    out.truncate(len(data) // 3)
print(json.dumps({"first": first, "again": run("a", "b")}))
"""


def test_rewriting_a_served_adapters_file_changes_nothing(base_and_adapters: tuple[Path, Path], tmp_path: Path) -> None:
    """An adapter in use is held in memory, not on a map of its file: rewriting the file (another adapter's
    bytes, cut short) neither kills the process (SIGBUS) nor changes the weights it serves."""
    import shutil

    base, one = base_and_adapters
    served = tmp_path / "served"
    shutil.copytree(one, served)
    other = make_adapter(base, tmp_path / "other", seed=7, r=8, targets=["q_proj", "v_proj", "down_proj"], std=0.5)
    p = subprocess.run([sys.executable, "-c", _REWRITE, str(base), str(served), str(other)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}: {p.stderr[-3000:]}"
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["again"] == out["first"] and len(out["first"]) == 8
