"""bench/gpu_check.py must run to the end before it ever meets a GPU: its --dry-run goes through every
section on tiny shapes, on CPU, under the Triton interpreter."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    table = out[out.rindex("=" * 100) :]
    lines = table.splitlines()
    correctness = [x for x in lines if x.startswith("correctness")]
    assert len(correctness) == 8 and all(" PASS " in x for x in correctness), table
    assert sum(x.startswith("decode ") and "B=2" in x for x in lines) == 2, table
    assert any(x.startswith("prefill ") for x in lines), table
    fused = [x for x in lines if x.startswith("fused")]
    assert len(fused) == 8 and all(" PASS " in x for x in fused), table
    # Padded decode buckets (graphs on a GPU) against eager steps: both batch sizes timed, same tokens.
    assert sum(x.startswith("graphs ") and "decode step B=" in x for x in lines) == 2, table
    same = re.search(r"(\d+)/(\d+) sequences identical", table)
    assert same and same[1] == same[2] and int(same[1]) > 0, table
    for side in ("ours", "transformers"):
        row = next(x for x in lines if x.startswith("end-to-end") and f" {side} " in x)
        assert "ok: 4/4 requests" in row and "errors 0" in row, table
    assert "ERROR" not in table, table
