"""`make demo`'s script, end to end on the tiny model: the sample batch through the embedded job server
and a worker into a results file, and nothing left running afterwards (also after Ctrl-C or a failure)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "scripts" / "demo.sh"
SAMPLE = ROOT / "cli" / "samples" / "demo.jsonl"
# Small engine settings for the tiny model on CPU (passed through to `sluice worker`).
WORKER_FLAGS = ["--", "--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-num-seqs", "4"]


def _env(tmp_path: Path, home: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    env.update(PYTHON=sys.executable, TMPDIR=str(tmp_path))
    if home is not None:
        env["SLUICE_HOME"] = str(home)
    return env


def _processes() -> list[tuple[int, int, str]]:
    """(pid, process group, command line) of every live (not zombie) process."""
    found = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            found.append((int(p.name), int(fields[2]), cmdline))
    return found


def assert_all_stopped(pgid: int, home: Path, timeout: float = 60.0) -> None:
    """Nothing of the demo's process group is left, nor a job server of its home (that one runs in its
    own session, so it outlives the demo unless the demo stops it)."""
    deadline = time.monotonic() + timeout
    while True:
        left = [(pid, cmd) for pid, group, cmd in _processes() if group == pgid or f"{home}/valkey/" in cmd]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not left, f"still running after the demo: {left}"


def _worker_live(home: Path) -> bool:
    """A worker has loaded its model and serves a queue of the job server of ``home``."""
    from sluice.jobs.connection import connect, find_server
    from sluice.jobs.store import served_queues

    server = find_server(home)
    if server is None:
        return False
    r = connect(server.url)
    try:
        return bool(served_queues(r))
    finally:
        r.close()


def _demo(tmp_path: Path, *args: str, home: Path | None = None) -> subprocess.Popen[str]:
    # A new session, as a terminal gives the command it runs; SIGINT at its default, so a test runner
    # started with SIGINT ignored (a background job) still lets the script trap it as Ctrl-C does.
    return subprocess.Popen(["bash", str(DEMO), *args], cwd=tmp_path, env=_env(tmp_path, home), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_demo_runs_the_sample_through_the_queue(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    out.write_text('{"stale": "from an earlier run"}\n')
    proc = _demo(tmp_path, "--model", str(tiny_model_dir), "-o", str(out), "--max-tokens", "4", *WORKER_FLAGS)
    log, _ = proc.communicate(timeout=600)  # give-up limits here bound a hang: a loaded machine starts slowly
    assert proc.returncode == 0, log

    lines = [json.loads(x) for x in out.read_text().splitlines()]
    sample = [json.loads(x)["custom_id"] for x in SAMPLE.read_text().splitlines() if x.strip()]
    assert sorted(x["custom_id"] for x in lines) == sorted(sample)  # this run's results only
    assert all(x["response"]["status_code"] == 200 for x in lines)
    assert "completed" in log and f"{len(sample)}/{len(sample)} done" in log  # sluice status
    assert "the first three:" in log
    assert len([line for line in log.splitlines() if line.startswith("--- ") and line[4:] in sample]) == 3
    assert not (tmp_path / "results.errors.jsonl").exists()

    # Its temporary SLUICE_HOME (under TMPDIR) is gone, and so is everything it started.
    home = Path(log.split("embedded Valkey in ", 1)[1].split()[0])
    assert home.parent == tmp_path and not home.exists()
    assert_all_stopped(proc.pid, home)


def test_demo_ctrl_c_stops_everything(tiny_model_dir: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    # Long enough that the batch is still running when Ctrl-C comes.
    proc = _demo(tmp_path, "--model", str(tiny_model_dir), "-o", str(tmp_path / "out.jsonl"), "--max-tokens", "3000",
                 *WORKER_FLAGS[:-1], "1", home=home)
    deadline = time.monotonic() + 600
    while not (tmp_path / "out.jsonl").exists() or not _worker_live(home):  # the batch is running
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    time.sleep(1)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 130, log
    assert_all_stopped(proc.pid, home)
    assert home.is_dir(), "a SLUICE_HOME the user gave is kept"


def test_demo_failure_stops_the_server_and_shows_the_worker_log(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = _demo(tmp_path, "--model", str(tmp_path / "no-such-model.gguf"), "-o", str(tmp_path / "out.jsonl"),
                 home=home)
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 1, log
    assert "the worker stopped before the batch was done" in log
    assert "the worker's last lines:" in log and "no-such-model.gguf" in log  # why, from the worker's log
    assert_all_stopped(proc.pid, home)


def test_demo_help_and_bad_arguments() -> None:
    help_text = subprocess.run(["bash", str(DEMO), "--help"], capture_output=True, text=True, check=True).stdout
    assert "Usage: scripts/demo.sh" in help_text and "--model" in help_text
    bad = subprocess.run(["bash", str(DEMO), "--nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown argument --nope" in bad.stderr


def test_make_demo_runs_the_script() -> None:
    """`make demo` is the script (with the environment's python), not a second copy of the steps."""
    # --no-print-directory: under `make test` this is a nested make, which would add "Leaving directory".
    dry = subprocess.run(["make", "--no-print-directory", "-n", "demo"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert "scripts/demo.sh" in dry.splitlines()[-1] and "PYTHON=" in dry.splitlines()[-1]
