"""The chaos run (bench/chaos.py) at suite scale: 300 jobs, 3 worker processes on the tiny model,
three kill -9s, a Valkey restart, a stalled results disk, a batch holding a request that breaks the
engine, a SIGSTOP past the heartbeat TTL and a cancelled batch; every promise of the job plane is
checked by the script, and its summary again here. The script runs in a
process group of its own: whatever it leaves running afterwards (a worker) fails the test and is killed,
so it cannot slow down the tests after it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fresh_seed
from jobs_helpers import ROOT

pytest_plugins = ["jobs_fixtures"]

# Alone it takes about 135 s; on a loaded 2-core machine several times that. Each of its phases has
# --timeout seconds, so a stuck run fails inside this limit with the phase it was waiting for.
TIME_LIMIT = 900
# Every fault comes at a fraction of the batch done, so a smaller batch meets the same faults; 500 jobs took
# 5 minutes of the suite on 2 cores.
JOBS = 300


def _group(pgid: int) -> list[str]:
    """The live processes of a process group, as "pid command"."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                out.append(f"{stat.parent.name} {command[:200]}")
        except (OSError, IndexError, ValueError):
            pass
    return out


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=TIME_LIMIT)
    except subprocess.TimeoutExpired:
        p.terminate()  # chaos.py kills its workers, stops its server and prints what it saw
        try:
            out, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        pytest.fail(f"chaos.py ran past {TIME_LIMIT}s\n{out[-3000:]}{err[-6000:]}")
    finally:
        left = _group(p.pid)
        if left:
            os.killpg(p.pid, signal.SIGKILL)
    assert not left, f"chaos.py left processes running (killed now): {left}"
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def test_chaos_300_jobs_three_workers(sluice_home: Path, tiny_model_dir: Path) -> None:
    seed = fresh_seed()
    cmd = [sys.executable, str(ROOT / "bench" / "chaos.py"), "--model", str(tiny_model_dir), "--jobs", str(JOBS),
           "--workers", "3", "--kills", "3", "--min-tokens", "16", "--max-tokens", "48", "--max-num-seqs", "16",
           "--max-deliveries", "5", "--timeout", "300", "--seed", str(seed)]
    p = _run(cmd)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    summary = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(summary, indent=1))
    assert summary["seed"] == seed and summary["outcomes"] == {"completed": JOBS}
    assert sum("kill -9 w" in e for e in summary["events"]) == 3
    assert any("SIGSTOP" in e for e in summary["events"]) and any("Valkey" in e for e in summary["events"])
    assert summary["cancelled_batch"].get("cancelled", 0) > 0
    # 3 kills and a SIGSTOP can put a job in at most 5 hands: 5 deliveries dead-letter no innocent job.
    assert summary["poisoned_batch"] == {"completed": 10, "failed": 1}
    assert 1 <= summary["sick_exits"] <= 5 + 1  # once unproven, then at most once per delivery
    assert any("results disk stalled" in e for e in summary["events"])
    assert set(summary["exit_codes"].values()) == {0}
