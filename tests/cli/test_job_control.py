"""Retries you can set, dead letters you can requeue, failed lines re-run (issue 43, items 1-3), on the real
embedded Valkey with real worker processes: a request fails while a file exists (bench/faults.py's
CHAOS_FAIL_WHILE: an input the operator can fix), is dead-lettered after --max-deliveries deliveries with a
backoff between them, is listed, requeued and completes exactly once; a worker killed -9 during a requeue
and during a retry still leaves each job exactly one outcome; `retry` of a finished batch with failed and
expired lines ends with every line completed, the counts right and each custom_id once in its output."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import redis
from cli_api_helpers import chat_lines, read_jsonl, run_sluice, start_sluice, stop, wait_for_url
from click.testing import CliRunner
from helpers import fresh_seed
from jobs_helpers import ROOT, assert_exactly_once, held_by, prompt_lines, wait_for, worker_process
from reliability_helpers import final, pending, run_to_end, tiny
from sluice.jobs import keys, spill
from sluice.jobs.reopen import ReopenRefused
from sluice.jobs.scripts import Scripts
from sluice.jobs.settings import RETRY_FLAGS, retry_backoff
from sluice.jobs.store import dead_letters, get_batch, get_result, queue_depth, read_results
from sluice.jobs.submit import DEFAULT_WINDOW, submit

from sluice.batch import Batch

pytest_plugins = ["jobs_fixtures"]

MARKER = "NEEDS-THE-ADAPTER"  # a request with this in its prompt fails while the flag file exists
FAILURE = re.compile(r"chaos: failing (\S+) at ([\d.]+)")


def faulty_worker(model_dir: Path, wid: str, flag: Path, log: Path, *args: str) -> subprocess.Popen:
    """A worker process (bench/faults.py) in which a step running a MARKER request raises while ``flag`` exists."""
    cmd = [sys.executable, str(ROOT / "bench" / "faults.py"), "--model", str(model_dir), "--queue", "tiny",
           "--dtype", "float32", "--worker-id", wid, "--heartbeat-ttl", "2", *args]
    env = {**os.environ, "CHAOS_FAIL_ON": MARKER, "CHAOS_FAIL_WHILE": str(flag)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def poison_lines(n: int, rng: random.Random, max_tokens: int = 4) -> list[str]:
    return [json.dumps({"custom_id": f"poison-{i}", "prompt": f"river {MARKER} {rng.randint(0, 999)}",
                        "max_tokens": max_tokens, "ignore_eos": True}) for i in range(n)]


def terminate(p: subprocess.Popen, log: Path) -> None:
    p.terminate()
    assert p.wait(timeout=60) == 0, log.read_text()[-3000:]


def sluice_ok(*args: str) -> subprocess.CompletedProcess:
    done = run_sluice(*args)
    assert done.returncode == 0, done.stderr
    return done


def output_ids(path: Path) -> list[str]:
    return [line["custom_id"] for line in read_jsonl(path)] if path.exists() else []


# ---- 1 + 2: max deliveries with backoff, dead letters listed and requeued --------------------------
def test_a_failing_job_is_dead_lettered_with_backoff_listed_requeued_and_completes_once(
        r: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The batch's own max deliveries (3, from `submit --max-deliveries`) wins over the worker's (5); the
    poison's last three failures are at least 1 s then 2 s apart (its backoff); `dead-letters` lists it;
    once the operator fixes its input, `requeue --ids` runs it once more and it completes in place of the
    failure: counts, results, output and error files say each line ran once."""
    rng = random.Random(fresh_seed())
    lines = prompt_lines(6, rng)
    lines.insert(rng.randrange(7), poison_lines(1, rng)[0])
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    bid = sluice_ok("submit", str(src), "--model", "tiny", "--max-deliveries", "3").stdout.strip()
    flag, log = tmp_path / "adapter-missing", tmp_path / "w.log"
    flag.touch()
    w = faulty_worker(tiny_model_dir, "w1", flag, log, "--max-deliveries", "5")
    try:
        wait_for(lambda: final(r, bid) or w.poll() is not None, 180, "the batch to finish")
        batch = get_batch(r, bid)
        assert batch.status == "completed" and (batch.counts.completed, batch.counts.failed) == (6, 1), log.read_text()
        dead = [json.loads(x) for x in sluice_ok("dead-letters", bid, "--json").stdout.splitlines()]
        assert [(d["custom_id"], d["deliveries"]) for d in dead] == [("poison-0", 3)]
        assert MARKER in dead[0]["error"] and dead[0]["job"]["custom_id"] == "poison-0"
        times = [float(t) for _, t in FAILURE.findall(log.read_text())]
        assert len(times) >= 3, log.read_text()[-3000:]
        # The documented backoff: 1 s after the first charged failure, 2 s after the second.
        assert (retry_backoff(1), retry_backoff(2)) == (1.0, 2.0)
        assert times[-2] - times[-3] >= 1.0 - 0.05 and times[-1] - times[-2] >= 2.0 - 0.05, times

        missing = run_sluice("requeue", bid, "--ids", "job-0")
        assert missing.returncode != 0 and len(missing.stderr.strip().splitlines()) == 1 and "job-0" in missing.stderr
        assert run_sluice("requeue", bid).returncode == 2  # neither --ids nor --all
        flag.unlink()  # the operator provides what the request needed
        assert "1 jobs requeued" in sluice_ok("requeue", bid, "--ids", "poison-0").stdout
        wait_for(lambda: final(r, bid), 120, "the requeued job to finish")
    finally:
        terminate(w, log)
    batch = get_batch(r, bid)
    assert batch.status == "completed" and (batch.counts.completed, batch.counts.failed) == (7, 0)
    entries = assert_exactly_once(r, bid, 7)
    assert all(e["status"] == "completed" for e in entries)
    assert sluice_ok("dead-letters", bid, "--json").stdout == "" and dead_letters(r, bid) == []
    out = tmp_path / "out.jsonl"
    sluice_ok("results", bid, "-o", str(out))
    assert sorted(output_ids(out)) == sorted(json.loads(x)["custom_id"] for x in lines)
    assert output_ids(tmp_path / "out.errors.jsonl") == []
    assert pending(r, bid) == 0 and r.hlen(keys.inputs(bid)) == 0


def _dead_lettered_batch(r: redis.Redis, tiny_model_dir: Path, tmp_path: Path, lines: list[str]) -> str:
    """``lines`` submitted (two deliveries each: a worker killed later costs one), run to the end by a worker
    in which MARKER requests fail; then their input is fixed."""
    b = submit(lines, r=r, model="tiny", metadata={"sluice_max_deliveries": "2"})
    flag, log = tmp_path / "adapter-missing", tmp_path / "faulty.log"
    flag.touch()
    w = faulty_worker(tiny_model_dir, "faulty", flag, log)
    try:
        wait_for(lambda: final(r, b.id) or w.poll() is not None, 180, "the batch to finish")
    finally:
        terminate(w, log)
    flag.unlink()
    return b.id


def _kill_9_holding(r: redis.Redis, bid: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """A paced worker killed -9 while it holds jobs of ``bid``; then another finishes the batch."""
    log = tmp_path / "doomed.log"
    doomed = worker_process(tiny_model_dir, "doomed", log=log, paced=True)
    try:
        wait_for(lambda: held_by(r, bid, "doomed") > 0 or doomed.poll() is not None, 120, "the worker to hold jobs")
        assert doomed.poll() is None, log.read_text()[-3000:]
    finally:
        doomed.kill()
        doomed.wait()
    log = tmp_path / "finisher.log"
    finisher = worker_process(tiny_model_dir, "finisher", "--exit-when-idle", "3", log=log)
    try:
        wait_for(lambda: final(r, bid), 180, "the batch to finish")
        assert finisher.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        finisher.kill()


def test_a_worker_killed_during_a_requeue_leaves_each_job_one_outcome(r: redis.Redis, tiny_model_dir: Path,
                                                                      tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 10
    bid = _dead_lettered_batch(r, tiny_model_dir, tmp_path, poison_lines(n, rng, max_tokens=40))
    assert get_batch(r, bid).counts.failed == n and len(dead_letters(r, bid)) == n
    assert f"{n} jobs requeued" in sluice_ok("requeue", bid, "--all").stdout
    assert get_batch(r, bid).status == "in_progress"
    _kill_9_holding(r, bid, tiny_model_dir, tmp_path)
    batch = get_batch(r, bid)
    assert batch.status == "completed" and (batch.counts.completed, batch.counts.failed) == (n, 0)
    assert all(e["status"] == "completed" for e in assert_exactly_once(r, bid, n))
    assert dead_letters(r, bid) == [] and pending(r, bid) == 0 and queue_depth(r, "tiny") == 0
    assert r.zscore(keys.finished_batches(), bid) is not None and r.zscore(keys.open_batches(), bid) is None


# ---- 3: retry a finished batch's failed and expired lines, through the HTTP API -------------------------
def test_retry_of_a_finished_batch_ends_with_every_line_once_despite_a_kill_9(r: redis.Redis, tiny_model_dir: Path,
                                                                             tmp_path: Path) -> None:
    """Failed (dead-lettered) and expired (a deadline already past) lines of a completed batch run again
    through POST /v1/batches/{id}/retry while a worker is killed -9 holding them: the batch ends completed,
    its counts right, its output file (rendered before the retry too) each custom_id once, its error file
    empty, no dead letter left."""
    rng = random.Random(fresh_seed())
    lines = prompt_lines(6, rng) + poison_lines(3, rng, max_tokens=40)
    lines += [json.dumps({"custom_id": f"late-{i}", "prompt": "gate water", "max_tokens": 40, "ignore_eos": True,
                          "deadline": 1}) for i in range(3)]
    rng.shuffle(lines)
    log = tmp_path / "serve.log"
    api = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log)
    try:
        url = wait_for_url(api, log, timeout=60)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        http = httpx.Client(base_url=url, timeout=60)
        bad = client.files.create(file=("x.jsonl", (chat_lines(rng, 1)[0] + "\n").encode()), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="sluice_max_deliveries"):
            client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"sluice_max_deliveries": "0"})
        own = client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h",
                                    metadata={"sluice_max_deliveries": "2"})
        (_, fields), = r.xrange(keys.jobs(own.id, 0))
        assert json.loads(fields["j"])["max_deliveries"] == 2 and own.metadata == {"sluice_max_deliveries": "2"}
        bid = _dead_lettered_batch(r, tiny_model_dir, tmp_path, lines)
        before = client.batches.retrieve(bid)
        assert before.status == "completed"
        assert (before.request_counts.completed, before.request_counts.total) == (6, 12)
        assert len(client.files.content(before.error_file_id).text.splitlines()) == 6
        listed = http.get(f"/v1/batches/{bid}/dead_letters").json()["data"]
        assert sorted(d["custom_id"] for d in listed) == [f"poison-{i}" for i in range(3)]

        got = http.post(f"/v1/batches/{bid}/retry")
        assert got.status_code == 200 and got.json()["queued"] == 6 and got.json()["status"] == "in_progress", got.text
        again = http.post(f"/v1/batches/{bid}/retry")  # not finished now: refused, nothing doubled
        assert again.status_code == 409 and "in_progress" in again.json()["error"]["message"]
        _kill_9_holding(r, bid, tiny_model_dir, tmp_path)

        after = client.batches.retrieve(bid)
        assert after.status == "completed" and after.request_counts.completed == after.request_counts.total == 12
        assert after.request_counts.failed == 0
        out = [json.loads(x) for x in client.files.content(after.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(json.loads(x)["custom_id"] for x in lines)
        assert after.error_file_id is None or client.files.content(after.error_file_id).text == ""
        assert http.get(f"/v1/batches/{bid}/dead_letters").json()["data"] == []
        assert http.post(f"/v1/batches/{bid}/retry").json()["queued"] == 0  # nothing left to retry
    finally:
        assert stop(api) == 0, log.read_text()[-3000:]
    assert all(e["status"] == "completed" for e in assert_exactly_once(r, bid, 12))
    assert pending(r, bid) == 0 and r.hlen(keys.inputs(bid)) == 0


def test_python_api_requeue_and_retry_refuse_what_cannot_run_again(r: redis.Redis, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:

    from sluice.batch import Batch

    rng = random.Random(fresh_seed())
    bid = _dead_lettered_batch(r, tiny_model_dir, tmp_path, poison_lines(2, rng))
    b = Batch(bid, None, None, [], r)  # type: ignore[arg-type]  # only the queue side is used
    assert sorted(d["custom_id"] for d in b.dead_letters()) == ["poison-0", "poison-1"]
    with pytest.raises(ReopenRefused, match="nope"):
        b.requeue(["nope"])
    t = time.time()
    reopened = b.requeue(["poison-1"])
    assert reopened.status == "in_progress" and reopened.completed_at is None
    assert reopened.expires_at >= t + DEFAULT_WINDOW - 1  # its completion window anew: housekeeping must not expire it
    assert r.zscore(keys.open_batches(), bid) is not None and r.zscore(keys.finished_batches(), bid) is None
    with pytest.raises(ReopenRefused, match="in_progress"):
        b.retry()
    assert [d["custom_id"] for d in b.dead_letters()] == ["poison-0"]
    assert b.status().counts.failed == 1


# ---- settings: validated, spelled once, the docs tell the truth ----------------------------------------
@pytest.mark.parametrize(("name", "value"), [("SLUICE_MAX_DELIVERIES", "0"), ("SLUICE_MAX_DELIVERIES", "x"),
                                             ("SLUICE_HEARTBEAT_TTL", "nan"), ("SLUICE_HEARTBEAT_TTL", "0.1")])
def test_a_bad_retry_setting_is_one_line(name: str, value: str) -> None:
    env = {**os.environ, name: value}
    for cmd in ([sys.executable, "-m", "sluice.worker", "--model", "x"], [str(Path(sys.executable).with_name("sluice")),
                                                                          "worker", "--model", "x"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 2, done.stderr
        assert name in done.stderr and "Traceback" not in done.stderr


def test_the_docs_retry_flags_exist_on_every_worker_command(capsys: pytest.CaptureFixture[str]) -> None:
    """Each flag the reliability page (docs/reliability.md) names is an option of `sluice worker`, `sluice up` and
    `python -m sluice.worker` (each spelled once, in jobs/settings.py)."""
    from sluice.cli.main import cli
    from sluice.worker.__main__ import main

    section = (ROOT / "docs" / "reliability.md").read_text()
    table = "\n".join(line for line in section.splitlines() if line.startswith("| "))
    retries = section[section.index("## Retries and dead letters"):section.index("```bash")]
    named = set(re.findall(r"`(--[a-z][a-z-]+)", table + retries))
    assert named >= {f.flag for f in RETRY_FLAGS}, named
    with pytest.raises(SystemExit):
        main(["--help"])
    helps = {"python -m sluice.worker": capsys.readouterr().out}
    for command in ("worker", "up"):
        helps[f"sluice {command}"] = CliRunner().invoke(cli, [command, "--help"]).output
    for flag in named:
        for where, text in helps.items():
            assert flag in text, f"{where} has no {flag}"


def test_a_failure_already_moved_to_files_is_replaced_too(r: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Results moved from Redis to files (SLUICE_RESULTS_SPILL's chunks) before a retry: readers see each
    job's new outcome once, never the failure left in a file."""
    rng = random.Random(fresh_seed())
    lines = prompt_lines(4, rng) + poison_lines(2, rng)
    bid = _dead_lettered_batch(r, tiny_model_dir, tmp_path, lines)
    assert spill.spill(r, Scripts(r), spill.files_dir(), bid, keep=0) == 6 and r.xlen(keys.results(bid)) == 0
    assert Batch(bid, None, None, [], r).retry().status == "in_progress"  # type: ignore[arg-type]
    run_to_end(r, bid, tiny(tiny_model_dir))
    got = read_results(r, bid).results
    assert sorted(x.idx for x in got) == list(range(6)) and all(x.status == "completed" for x in got)
    assert get_result(r, bid, "poison-1").status == "completed"
    batch = get_batch(r, bid)
    assert (batch.status, batch.counts.completed, batch.counts.failed) == ("completed", 6, 0)
