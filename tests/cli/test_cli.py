"""The queue commands through click's runner, on a real embedded Valkey with a tiny-model worker in a
thread: submit -> status -> results -> cancel, resuming, and user errors (bad file, unknown id, unknown
model, a down job server) as one line and an exit code."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_api_helpers import free_port, read_jsonl, simple_lines, sluice_home, tiny_worker
from click.testing import CliRunner, Result
from helpers import fresh_seed
from sluice.cli.common import EXIT_SERVER_DOWN, EXIT_SOME_FAILED, EXIT_USER_ERROR
from sluice.cli.main import cli


@pytest.fixture(scope="module")
def home(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with sluice_home(tmp_path_factory.mktemp("cli") / "home") as h, tiny_worker(tiny_model_dir, queue="tiny"):
        yield h


def invoke(*args: str | Path, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def assert_one_line_error(res: Result, code: int, text: str) -> None:
    assert res.exit_code == code, res.output
    assert isinstance(res.exception, SystemExit), res.exception  # not a traceback
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and text in lines[0], res.stderr


def test_submit_wait_then_status_results_and_resume(home: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    n, max_tokens = rng.randint(8, 20), rng.randint(2, 5)
    lines = simple_lines(rng, n, max_tokens=max_tokens)
    bad = {"{torn json": None, json.dumps({"custom_id": "odd", "prompt": "x", "colour": "red"}): "odd"}
    at = sorted(rng.sample(range(n + len(bad)), len(bad)))
    for pos, text in zip(at, bad, strict=True):
        lines.insert(pos, text)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")

    res = invoke("submit", src, "--wait", "-o", out)
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    bid = res.stdout.strip()
    got = read_jsonl(out)
    assert sorted(x["custom_id"] for x in got) == sorted(f"job-{i}" for i in range(n))
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in got)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")
    assert [(e["id"], e["error"]["line"], e["custom_id"]) for e in errors] == \
        [(f"line-{p + 1}", p + 1, cid) for p, cid in zip(at, bad.values(), strict=True)]
    assert f"completed: {n} completed, 0 failed, 2 bad lines" in res.stderr

    res = invoke("status", bid)
    assert res.exit_code == 0 and f"{bid}  completed" in res.stdout and f"{n}/{n} done" in res.stdout
    assert "2 bad input lines" in res.stdout and "tokens/s" in res.stdout
    obj = json.loads(invoke("status", bid, "--json").stdout)
    assert obj["id"] == bid and obj["status"] == "completed" and obj["object"] == "batch"
    assert obj["request_counts"] == {"total": n, "completed": n, "failed": 0}
    assert obj["created_at"] <= obj["in_progress_at"] <= obj["completed_at"]
    assert bid in {b["id"] for b in json.loads(invoke("batches", "--json").stdout)["data"]}
    assert bid in invoke("batches").stdout

    res = invoke("results", bid)  # to stdout: every outcome line; the bad lines on stderr
    assert res.exit_code == 0 and len(res.stdout.splitlines()) == n and res.stderr.count("line ") == 2
    again = tmp_path / "again.jsonl"
    assert invoke("results", bid, "-o", again).exit_code == EXIT_SOME_FAILED
    assert read_jsonl(again) == [json.loads(x) for x in res.stdout.splitlines()]
    torn = again.read_text()[: len(again.read_text()) // 2]  # an interrupted run: half the lines, one torn
    again.write_text(torn)
    assert invoke("results", bid, "-o", again).exit_code == EXIT_SOME_FAILED
    assert sorted(x["custom_id"] for x in read_jsonl(again)) == sorted(f"job-{i}" for i in range(n))
    assert len(read_jsonl(again.with_name("again.errors.jsonl"))) == 2

    assert_one_line_error(invoke("cancel", bid), EXIT_USER_ERROR, "already completed")


def test_cancel_while_running(home: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 150
    src = tmp_path / "big.jsonl"
    src.write_text("\n".join(simple_lines(rng, n, max_tokens=32, ignore_eos=True)) + "\n")
    obj = json.loads(invoke("submit", src, "--json").stdout)
    assert obj["request_counts"]["total"] == n and obj["status"] == "in_progress"

    res = invoke("cancel", obj["id"], "--json")
    assert res.exit_code == 0 and json.loads(res.stdout)["status"] in ("cancelling", "cancelled")
    res = invoke("status", obj["id"], "--watch", "--interval", "0.2")
    assert res.exit_code == 0 and f"{obj['id']}  cancelled" in res.stdout.strip().split("\n\n")[-1]
    out = tmp_path / "big.results.jsonl"
    res = invoke("results", obj["id"], "-o", out)
    assert res.exit_code == EXIT_SOME_FAILED
    errors = read_jsonl(tmp_path / "big.results.errors.jsonl")
    assert errors and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert len(errors) + len(read_jsonl(out)) == n


def test_user_errors_are_one_line_and_an_exit_code(home: Path, tmp_path: Path) -> None:
    for cmd in ("status", "results", "cancel"):
        assert_one_line_error(invoke(cmd, "batch_nope"), EXIT_USER_ERROR, "no batch 'batch_nope'")
    assert_one_line_error(invoke("submit", tmp_path / "missing.jsonl"), EXIT_USER_ERROR, "cannot read")
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b"\x00\xff binary\nnot json either\n")
    assert_one_line_error(invoke("submit", junk), EXIT_USER_ERROR, "no valid requests in")
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"prompt": "hi"}\n')
    assert_one_line_error(invoke("submit", ok, "--model", "gpt-4o"), EXIT_USER_ERROR, "no worker serves model 'gpt-4o'")
    assert invoke("submit", ok, "--completion-window", "soon").exit_code == 2  # click's usage error

    down = {"SLUICE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    for args in (("submit", ok), ("status", "b"), ("results", "b"), ("cancel", "b"), ("batches",)):
        assert_one_line_error(invoke(*args, env=down), EXIT_SERVER_DOWN, "cannot reach the job server")


def test_worker_command_serves_a_queue_until_idle(home: Path, tiny_model_dir: Path) -> None:
    res = invoke("worker", "--model", tiny_model_dir, "--queue", "tiny", "--worker-id", "cli-worker", "--dtype",
                 "float32", "--kv-cache-memory", "8MiB", "--exit-when-idle", "0.5")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stderr.strip().splitlines()[-1])["worker_id"] == "cli-worker"
    assert_one_line_error(invoke("worker", "--model", home / "no-such-model", "--exit-when-idle", "0.5"),
                          EXIT_USER_ERROR, "cannot start the worker")
