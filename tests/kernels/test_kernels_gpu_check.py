"""bench/gpu_check.sh must run to the end before it ever meets a GPU: its --dry mode goes through every
section's Python on tiny shapes, on CPU, under the Triton interpreter, and writes each row as a JSON line
as it is made."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(1500)
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1400)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "gpu_check.jsonl").read_text().splitlines()]
    log = (tmp_path / "gpu_check.log").read_text()
    table = out[out.rindex("=" * 100) :]
    assert "seed=" in log and table in log
    # Every row of the final table was written as a JSON line, in order, as it was made.
    assert [r["item"] for r in rows] == [re.split(r"\s{2,}", x)[1] for x in table.splitlines()[1:]]
    assert [r["t_s"] for r in rows] == sorted(r["t_s"] for r in rows)
    by = {s: [r for r in rows if r["section"] == s] for s in {r["section"] for r in rows}}
    correctness = by["correctness"]
    kernels = {"kv_write", "decode", "decode_3_splits", "decode_1_split", "decode_window_softcap", "prefill",
               "prefill_window_softcap", "head_major_int64", "kv_write_int8", "decode_int8", "decode_int8_3_splits",
               "prefill_int8"}
    assert {r["item"] for r in correctness} == {f"{k} {d}" for k in kernels for d in ("float32", "float16")}
    assert all(r["result"] == "PASS" and r["error"] <= r["tol"] for r in correctness), correctness
    assert sum(r["item"].startswith("B=2 ") for r in by["decode"]) == 2
    assert by["prefill"]
    assert len(by["fused"]) == 8 and all(r["result"] == "PASS" for r in by["fused"])
    engine = {r["item"]: r for r in by["engine"]}
    assert set(engine) == {"prefill logits vs transformers (float32)", "decode logits: graph vs same bucket eager",
                           "decode logits: padded graph vs unpadded eager", "greedy tokens vs transformers (float32)",
                           "preemption", "prefix caching", "seeded sampled batch"}, engine
    assert all(r["result"] == "PASS" for r in engine.values()), engine
    assert engine["preemption"]["preemptions"] > 0 and engine["prefix caching"]["hits"] > 0
    tp = by["tp"]  # tensor parallelism: two gloo ranks on the CPU in the dry run
    assert [r["result"] for r in tp] == ["PASS"] and tp[0]["preemptions"] > 0, tp
    # Padded decode buckets against eager steps: each batch size timed with its batch checked, same tokens.
    steps = [r for r in by["graphs"] if r["item"].startswith("decode step B=")]
    assert [r["batch"] for r in steps] == [1, 3]
    same = next(r for r in by["graphs"] if r["item"] == "greedy tokens")
    assert same["identical"] == same["of"] > 0
    for side in ("ours", "transformers"):
        row = next(r for r in by["end-to-end"] if r["item"] == side)
        assert row["status"] == "ok" and row["done"] == 4 and "errors 0" in row["detail"], row
    assert next(r for r in by["end-to-end"] if r["item"] == "speed-up")["both_finished"]
    assert rows[-1]["item"] == "total" and rows[-1]["ok"]
    assert not [r for r in rows if r["result"] in ("ERROR", "INCOMPLETE", "FAIL")]
