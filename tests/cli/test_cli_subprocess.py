"""``sluice`` as real processes: ``sluice up`` (embedded job server + tiny-model worker + API in one
foreground process), then submit -> status -> results -> cancel from other processes, user errors with
their exit codes, and Ctrl-C stopping everything ``up`` started."""

from __future__ import annotations

import json
import os
import random
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from cli_api_helpers import free_port, read_jsonl, run_sluice, simple_lines, start_sluice, stop, wait_for_url
from helpers import fresh_seed
from jobs_helpers import wait_for
from sluice.cli.common import EXIT_SERVER_DOWN, EXIT_SOME_FAILED, EXIT_USER_ERROR
from sluice.jobs.connection import find_server, stop_server


@dataclass
class Up:
    url: str
    home: Path
    env: dict[str, str]
    proc: subprocess.Popen
    log: Path

    def sluice(self, *args: str | Path, **env: str) -> subprocess.CompletedProcess:
        return run_sluice(*(str(a) for a in args), env={**self.env, **env})


@pytest.fixture(scope="module")
def up(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    home = tmp_path_factory.mktemp("up") / "home"
    env = {k: v for k, v in os.environ.items() if k not in ("SLUICE_REDIS_URL", "SLUICE_API_KEY")}
    env["SLUICE_HOME"] = str(home)
    log = home.parent / "up.log"
    proc = start_sluice("up", "--model", str(tiny_model_dir), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                        "--max-num-seqs", "16", "--port", "0", "--grace-period", "5", log=log, env=env)
    try:
        yield Up(wait_for_url(proc, log, timeout=180), home, env, proc, log)
    finally:
        stop(proc)
        stop_server(home, kill=True)  # in case a failed test left it


def assert_user_error(res: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert text in res.stderr, res.stderr


def test_submit_status_results_cancel(up: Up, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    n = rng.randint(5, 12)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(simple_lines(rng, n, max_tokens=3)) + "\n")

    res = up.sluice("submit", src, "--wait", "-o", out)
    assert res.returncode == 0, res.stderr
    bid = res.stdout.strip()
    assert sorted(x["custom_id"] for x in read_jsonl(out)) == sorted(f"job-{i}" for i in range(n))
    assert not (tmp_path / "out.errors.jsonl").exists()
    res = up.sluice("status", bid)
    assert res.returncode == 0 and f"{n}/{n} done" in res.stdout and "completed" in res.stdout
    assert json.loads(up.sluice("status", bid, "--json").stdout)["request_counts"]["completed"] == n
    again = tmp_path / "again.jsonl"
    for _ in range(2):  # the second run finds everything there and adds nothing
        assert up.sluice("results", bid, "-o", again).returncode == 0
        assert sorted(x["id"] for x in read_jsonl(again)) == sorted(x["id"] for x in read_jsonl(out))

    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(simple_lines(rng, 400, max_tokens=64, ignore_eos=True)) + "\n")
    res = up.sluice("submit", big, "--json")
    assert res.returncode == 0, res.stderr
    bid2 = json.loads(res.stdout)["id"]
    res = up.sluice("cancel", bid2)
    assert res.returncode == 0 and bid2 in res.stdout and "cancel" in res.stdout
    res = up.sluice("results", bid2, "--follow", "-o", tmp_path / "big.out.jsonl")
    assert res.returncode == EXIT_SOME_FAILED, res.stderr
    cancelled = read_jsonl(tmp_path / "big.out.errors.jsonl")
    assert cancelled and {x["error"]["code"] for x in cancelled} == {"batch_cancelled"}
    assert bid in up.sluice("batches").stdout


def test_the_api_of_up(up: Up, tiny_model_dir: Path) -> None:
    http = httpx.Client(base_url=up.url, timeout=30)
    assert http.get("/healthz").json()["models"] == [str(tiny_model_dir)]
    job = http.post("/v1/jobs", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}).json()
    done = wait_for(lambda: (j := http.get(f"/v1/jobs/{job['id']}").json())["status"] == "completed" and j, 60,
                    "the job")
    assert done["response"]["body"]["object"] == "chat.completion"


def test_user_errors_as_processes(up: Up, tmp_path: Path) -> None:
    assert_user_error(up.sluice("status", "batch_nope"), EXIT_USER_ERROR, "no batch 'batch_nope'")
    assert_user_error(up.sluice("submit", tmp_path / "nope.jsonl"), EXIT_USER_ERROR, "cannot read")
    bad = tmp_path / "bad.jsonl"
    bad.write_text("this is not JSONL\n")
    assert_user_error(up.sluice("submit", bad), EXIT_USER_ERROR, "no valid requests in")
    down = f"redis://127.0.0.1:{free_port()}/0"
    assert_user_error(up.sluice("status", "x", SLUICE_REDIS_URL=down), EXIT_SERVER_DOWN, "cannot reach the job server")
    assert_user_error(up.sluice("submit", bad, SLUICE_REDIS_URL=down), EXIT_SERVER_DOWN, "cannot reach the job server")
    port = up.url.rsplit(":", 1)[1]
    assert_user_error(up.sluice("serve", "--port", port), EXIT_USER_ERROR, f"cannot listen on 127.0.0.1:{port}")
    assert "Exit codes:" in up.sluice("--help").stdout


def test_ctrl_c_stops_what_up_started(up: Up) -> None:
    assert find_server(up.home) is not None
    assert stop(up.proc, timeout=60) == 0, up.log.read_text()
    assert "worker stopped" in up.log.read_text()
    assert find_server(up.home) is None
