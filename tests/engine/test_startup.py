"""Start-up: the engine's phase line, and bench/startup.py's reading of a run's log."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from sluice.engine.startup_clock import StartupClock, parse_line

ROOT = Path(__file__).resolve().parents[2]


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("bench_startup", ROOT / "bench" / "startup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_startup"] = module
    spec.loader.exec_module(module)
    return module


def test_clock_line_parses_back() -> None:
    clock = StartupClock()
    for phase in ("config", "weights", "config"):
        clock.lap(phase)
    parsed = parse_line("INFO sluice.engine.llm: " + clock.line())
    assert parsed is not None
    assert list(parsed) == ["total", "config", "weights"]
    assert abs(parsed["config"] - round(clock.phases["config"], 2)) < 1e-9
    assert abs(parsed["total"] - sum(parsed[k] for k in ("config", "weights"))) <= 0.011
    assert parse_line("INFO nothing here") is None


def test_bench_phases_from_a_log() -> None:
    bench = _bench()
    log = "\n".join([
        "@100.0000 STARTUP python",
        "@100.5000 STARTUP imported",
        "@101.0000 INFO sluice.engine.linear: linear layers: onednn-packed (211 replaced): x (measured earlier: /c/gemm.json)",
        "@101.1000 INFO sluice.engine.llm: dtype auto: float32 on this CPU: y",
        "@103.0000 INFO sluice.engine.llm: start-up in 1.50 s: config 0.20, weights 1.00, kv_cache 0.30",
    ])
    row = bench.phases(log, t_spawn=99.9, t_first=103.25)  # type: ignore[attr-defined]
    assert abs(row["interpreter"] - 0.1) < 1e-6
    assert abs(row["cli import"] - 0.5) < 1e-6
    assert abs(row["to engine"] - 1.0) < 1e-6  # 103.0 - 1.5 - 100.5
    assert row["weights"] == 1.0
    assert abs(row["first result"] - 0.25) < 1e-6
    assert abs(row["total"] - 3.35) < 1e-6
    assert row["cache"] == "GEMM cached, dtype measured"
