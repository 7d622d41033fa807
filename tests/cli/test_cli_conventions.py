"""The CLI's habits, on real embedded servers: `sluice server status|start|stop`, the one-line notice when
a command starts the server, --version, `-` for stdin and stdout, options read from the environment,
every documented exit code, JSON Lines from `status --json --watch`, and `batches` paging."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cli_api_helpers import (
    ROOT,
    SLUICE,
    default_sigint,
    free_port,
    run_sluice,
    simple_lines,
    sluice_home,
    tiny_worker,
)
from click.testing import CliRunner, Result
from helpers import fresh_seed
from sluice.cli.common import EXIT_SERVER_DOWN, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_USER_ERROR
from sluice.cli.main import cli
from sluice.jobs.connection import find_server, stop_server

STARTED = "started the embedded job server"


def invoke(*args: str | Path, env: dict[str, str] | None = None, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args], env=env, input=input)


@pytest.fixture(scope="module")
def busy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A home with a tiny-model worker serving the queue "tiny"."""
    with sluice_home(tmp_path_factory.mktemp("conv") / "home") as h, tiny_worker(tiny_model_dir, queue="tiny"):
        yield h


@pytest.fixture
def idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh home with no server running (and none left afterwards) and no worker."""
    home = tmp_path / "home"
    monkeypatch.setenv("SLUICE_HOME", str(home))
    yield home
    stop_server(home, kill=True)


def _pid_gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ---- the embedded server's lifecycle -------------------------------------------------------------
def test_server_status_start_stop_and_the_start_notice(idle: Path, tmp_path: Path) -> None:
    res = invoke("server", "status")
    assert res.exit_code == EXIT_SERVER_DOWN and "not running" in res.stdout and str(idle) in res.stdout

    first, second = invoke("batches"), invoke("batches")  # the first starts it and says so, once
    assert first.exit_code == second.exit_code == 0, first.output
    assert first.stderr.count(STARTED) == 1 and "sluice server stop" in first.stderr and STARTED not in second.stderr
    server = find_server(idle)
    assert server is not None and f"pid {server.pid}" in first.stderr

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    assert invoke("submit", src).exit_code == 0
    status = json.loads(invoke("server", "status", "--json").stdout)
    assert status["running"] and status["pid"] == server.pid and status["address"] == f"127.0.0.1:{server.port}"
    assert status["data_dir"] == str((idle / "valkey").resolve()) and status["batches"] == 1
    assert status["used_memory"] > 0
    text = invoke("server", "status")
    assert text.exit_code == 0 and f"pid      {server.pid}" in text.stdout and "batches  1" in text.stdout

    assert "already running" in invoke("server", "start").stderr and find_server(idle) == server
    res = invoke("server", "stop")
    assert res.exit_code == 0 and f"stopped the embedded job server (pid {server.pid})" in res.stderr
    assert find_server(idle) is None and _pid_gone(server.pid)
    assert invoke("server", "stop").exit_code == 0  # stopping a stopped server is not an error

    res = invoke("server", "start")
    assert res.exit_code == 0 and STARTED in res.stderr
    again = find_server(idle)
    assert again is not None and json.loads(invoke("server", "status", "--json").stdout)["batches"] == 1  # AOF
    external = {"SLUICE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    for action in ("start", "stop"):
        res = invoke("server", action, env=external)
        assert res.exit_code == EXIT_USER_ERROR and "SLUICE_REDIS_URL is set" in res.stderr
    assert invoke("server", "status", env=external).exit_code == EXIT_SERVER_DOWN
    assert invoke("server", "stop").exit_code == 0 and _pid_gone(again.pid)


def test_up_stops_the_server_only_if_it_started_it(idle: Path, tmp_path: Path) -> None:
    up = ("up", "--model", tmp_path / "no-such-model", "--port", "0")  # fails fast, after the server is up
    res = invoke(*up)
    assert res.exit_code == EXIT_USER_ERROR and "cannot start the worker" in res.stderr
    assert "started the embedded job server" in res.stderr and find_server(idle) is None  # its own: stopped
    assert invoke("server", "start").exit_code == 0
    before = find_server(idle)
    res = invoke(*up)
    assert res.exit_code == EXIT_USER_ERROR and STARTED not in res.stderr
    assert find_server(idle) == before  # running before `up`: left running


# ---- standard habits -----------------------------------------------------------------------------
def test_version() -> None:
    res = invoke("--version")
    assert res.exit_code == 0 and res.stdout.strip() == f"sluice, version {importlib.metadata.version('sluice-llm')}"


def test_dash_is_stdin_and_stdout(busy: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    n = rng.randint(3, 6)
    lines = "\n".join(simple_lines(rng, n, max_tokens=3)) + "\n"
    env = dict(os.environ)
    done = subprocess.run([SLUICE, "submit", "-", "--wait", "--model", "tiny"], input=lines, env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = [json.loads(x) for x in done.stdout.splitlines()]  # results on stdout, the batch id on stderr
    assert sorted(x["custom_id"] for x in got) == sorted(f"job-{i}" for i in range(n))
    bid = re.search(r"^(batch_\w+)$", done.stderr, re.M)[1]  # type: ignore[index]
    again = run_sluice("results", bid, "-o", "-", env=env)
    assert again.returncode == 0 and sorted(again.stdout.splitlines()) == sorted(done.stdout.splitlines())

    gen = subprocess.run([SLUICE, "generate", "-", "-o", "-", "--model", str(tiny_model_dir), "--dtype", "float32",
                          "--kv-cache-memory", "16MiB", "--no-progress"], input=lines + "not json\n", cwd=tmp_path,
                         capture_output=True, text=True, timeout=180)
    assert gen.returncode == EXIT_SOME_FAILED, gen.stderr
    out = {x["custom_id"]: x for x in map(json.loads, gen.stdout.splitlines())}
    bad = out.pop(f"line-{n + 1}")  # with -o -, the errors stream is stdout too, not a file named "-.errors"
    assert bad["error"]["line"] == n + 1 and list(tmp_path.iterdir()) == []
    assert sorted(out) == sorted(f"job-{i}" for i in range(n)) and "-> stdout" in gen.stderr
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 3 for x in out.values())
    res = invoke("generate", "-", "-o", "-", "--resume", input=lines)
    assert res.exit_code == EXIT_USAGE and "--resume" in res.stderr


def test_options_read_from_the_environment(busy: Path, tiny_model_dir: Path) -> None:
    env = {"SLUICE_MODEL": str(tiny_model_dir), "SLUICE_DTYPE": "float32", "SLUICE_KV_CACHE_MEMORY": "8MiB",
           "SLUICE_QUEUE": "tiny", "SLUICE_WORKER_ID": "env-worker", "SLUICE_GRACE_PERIOD": "1"}
    res = invoke("worker", "--exit-when-idle", "0.5", env=env)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stderr.strip().splitlines()[-1])["worker_id"] == "env-worker"
    ctx = cli.commands["worker"].make_context("worker", ["--max-num-seqs", "3"])
    assert ctx.params["max_num_seqs"] == 3  # a flag beats its variable
    bad = invoke("worker", env={"SLUICE_KV_CACHE_MEMORY": "lots"})
    assert bad.exit_code == EXIT_USAGE and "SLUICE_KV_CACHE_MEMORY" not in bad.stdout
    assert "'lots' is not a size" in bad.stderr
    help_text = " ".join(invoke("worker", "--help").stdout.split())
    assert all(f"[env var: SLUICE_{v}" in help_text for v in ("MODEL", "MODEL_IMPL", "ENFORCE_EAGER"))


def test_every_documented_exit_code(idle: Path, tmp_path: Path) -> None:
    documented = {int(c) for c in re.findall(r"^\s+(\d+)\s{2,}", invoke("--help").stdout.split("Exit codes:")[1],
                                              re.M)}
    seen: set[int] = set()

    def expect(code: int, res: Result | subprocess.CompletedProcess, text: str = "") -> None:
        got = res.exit_code if isinstance(res, Result) else res.returncode
        assert got == code and text in res.stderr, (code, res.stderr)
        assert "Traceback" not in res.stderr
        seen.add(code)

    src, bad = tmp_path / "in.jsonl", tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "hi", "max_tokens": 2}\n')
    bad.write_text('{"prompt": "hi"}\nnot json\n')
    bid = invoke("submit", src).stdout.strip()
    expect(0, invoke("status", bid))
    expect(EXIT_USER_ERROR, invoke("status", "batch_nope"), "no batch 'batch_nope'")
    expect(EXIT_USER_ERROR, invoke("batches", env={"SLUICE_REDIS_URL": "http://x"}), "SLUICE_REDIS_URL")
    expect(EXIT_USAGE, invoke("submit", src, "--completion-window", "soon"), "'soon' is not a duration")
    expect(EXIT_USAGE, invoke("worker", "--kv-cache-memory", "lots"), "'lots' is not a size")
    expect(EXIT_USAGE, invoke("status", bid, "--nope"), "No such option")
    expect(EXIT_USAGE, invoke("status"), "Missing argument")
    expect(EXIT_SOME_FAILED, invoke("submit", bad), "1 bad lines")
    expect(EXIT_SERVER_DOWN, invoke("batches", env={"SLUICE_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}),
           "cannot reach the job server")
    # Ctrl-C while watching a batch no worker runs: 130, and the batch runs on.
    expect(130, ctrl_c_while_watching(bid), "stopped watching")
    assert invoke("status", bid, "--json").exit_code == 0
    assert seen == documented, f"the help documents {sorted(documented)}, the tests saw {sorted(seen)}"


def ctrl_c_while_watching(bid: str, before: Callable[[], None] = lambda: None) -> subprocess.CompletedProcess:
    """``sluice status BID --watch``, Ctrl-C once it has printed (and ``before()`` ran); it must exit within 30 s."""
    proc = subprocess.Popen([SLUICE, "status", bid, "--watch", "--interval", "0.2"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)
    try:
        assert bid in proc.stdout.readline()  # type: ignore[union-attr]
        before()
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=30)
        print(f"exited {proc.returncode} {time.monotonic() - t0:.1f}s after Ctrl-C")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        proc.kill()  # a watch that ignored Ctrl-C: not left running after the test
        proc.wait()


def test_ctrl_c_while_the_job_server_hangs(idle: Path, tmp_path: Path) -> None:
    """Ctrl-C lands while the watch waits on a job server that does not answer (SIGSTOPped): 130 at once,
    one line, no traceback; not after the client's socket timeout and retries."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    bid = invoke("submit", src).stdout.strip()
    server = find_server(idle)
    assert server is not None

    def hang() -> None:
        os.kill(server.pid, signal.SIGSTOP)
        time.sleep(1.0)  # several refreshes (0.2 s): the watch is now blocked on its Redis call

    try:
        res = ctrl_c_while_watching(bid, before=hang)
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert res.returncode == 130 and res.stderr.strip() == "stopped watching", res.stderr
    assert invoke("status", bid).exit_code == 0  # the server runs on


# ---- JSON output ---------------------------------------------------------------------------------
def test_status_json_watch_prints_json_lines(busy: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(simple_lines(rng, 40, max_tokens=12, ignore_eos=True)) + "\n")
    bid = invoke("submit", src, "--model", "tiny").stdout.strip()
    res = invoke("status", bid, "--json", "--watch", "--interval", "0.1")
    assert res.exit_code == 0, res.output
    snapshots = [json.loads(line) for line in res.stdout.splitlines()]  # every line one object
    assert len(snapshots) >= 2 and {s["id"] for s in snapshots} == {bid}
    done = [s["request_counts"]["completed"] for s in snapshots]
    assert done == sorted(done) and snapshots[-1]["status"] == "completed" and done[-1] == 40


def test_batches_pages(idle: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    made = [invoke("submit", src).stdout.strip() for _ in range(5)]
    seen: list[str] = []
    after: list[str] = []
    while True:
        page = json.loads(invoke("batches", "--json", "--limit", "2", *after).stdout)
        assert page["object"] == "list" and len(page["data"]) <= 2
        seen += [b["id"] for b in page["data"]]
        assert page["last_id"] == page["data"][-1]["id"]
        if not page["has_more"]:
            break
        after = ["--after", page["last_id"]]
    assert seen == made[::-1]  # newest first, each once
    text = invoke("batches", "--limit", "2")
    assert f"sluice batches --after {made[3]}" in text.stderr and len(text.stdout.splitlines()) == 3
    res = invoke("batches", "--after", "batch_nope")
    assert res.exit_code == EXIT_USER_ERROR and "no batch 'batch_nope'" in res.stderr


def test_submit_and_generate_take_the_same_sampling_flags(idle: Path, tmp_path: Path) -> None:
    names = {"max_tokens", "temperature", "top_p", "seed"}
    for command in ("submit", "generate"):
        assert names <= {p.name for p in cli.commands[command].params}, command
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": "b", "seed": 1, "max_tokens": 3}\n')
    bid = invoke("submit", src, "--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9", "--seed", "42",
                 "--completion-window", "1.5h").stdout.strip()
    from sluice.jobs import keys
    from sluice.jobs.connection import connect

    r = connect()
    jobs = {j["custom_id"]: j for j in (json.loads(f["j"]) for _, f in r.xrange(keys.jobs(bid, 0)))}
    r.close()
    first, second = jobs["line-1"]["params"], jobs["line-2"]["params"]
    assert (first["max_tokens"], first["temperature"], first["top_p"], first["seed"]) == (7, 0.5, 0.9, 42)
    assert (second["max_tokens"], second["seed"], second["top_p"]) == (3, 1, 0.9)  # a line's own fields win
    status = json.loads(invoke("status", bid, "--json").stdout)
    assert status["expires_at"] - status["created_at"] == 5400  # 1.5h, by the parser the API uses too
