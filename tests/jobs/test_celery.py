"""Celery interop end to end: a real Celery worker process (threads pool, 64 slots) running
jobs.celery_app, the real embedded Valkey, and a Sluice worker on the tiny model in a thread.

The Celery worker only forwards: each generate queues one job and blocks on its result, so the
Sluice worker still batches them. Pipeline stages (tests/support/celery_stages.py) note in Redis when
they ran and what their batch looked like, which is how "once" and "after the last result" are seen.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import chain
from celery.exceptions import TaskRevokedError
from celery_stages import fired
from cli_api_helpers import sluice_home
from helpers import fresh_seed
from jobs_helpers import ThreadWorker, assert_exactly_once, prompt_lines, wait_for

# The tasks by module, not by name: pytest's collection reads attributes of this module's names, which
# evaluates Celery's task proxies, then its config, and so started an embedded server (in the user's data
# directory, before the session had its own SLUICE_HOME) that nothing stopped.
from sluice.jobs import celery_app as tasks
from sluice.jobs import keys
from sluice.jobs.celery_app import GenerationTimeout, _redis, app, batch_id_for
from sluice.jobs.connection import connect, redis_url
from sluice.jobs.scripts import Scripts, sweep, transition
from sluice.jobs.store import cancel_batch, get_batch, queue_depth, retire_batch
from sluice.jobs.submit import submit

ROOT = Path(__file__).resolve().parents[2]
CELERY = str(Path(sys.executable).with_name("celery"))
WORDS = ["sluice", "river", "gate", "water", "stone", "mill", "wheel", "bank", "flow", "lock", "weir", "canal"]
SETTLE = 2.5  # seconds to let a second firing show up, were there one (the sender blocks 1s at a time)


@dataclass
class Stack:
    r: redis.Redis
    log: Path
    tmp: Path  # holds pipeline.py, the docs' stages (docs/deployment.md), which the Celery worker loads

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The module's SLUICE_HOME and embedded Valkey, with a Celery worker serving sluice.jobs.celery_app."""
    tmp = tmp_path_factory.mktemp("celery")
    with sluice_home(tmp / "home"):
        _redis.cache_clear()  # this process's client follows the module's server
        url = redis_url()
        app.conf.update(broker_url=url, result_backend=url)
        log = tmp / "celery.log"
        (tmp / "pipeline.py").write_text(readme_python()[0])
        node = f"sluice-test-{os.getpid()}@localhost"
        proc = _start_celery(node, log, tmp)
        r = connect()
        try:
            _wait_ready(proc, node, log)
            yield Stack(r, log, tmp)
        finally:
            _stop(proc)
            r.close()
            _redis.cache_clear()


def _start_celery(node: str, log: Path, tmp: Path) -> subprocess.Popen:
    cmd = [CELERY, "-A", "sluice.jobs.celery_app", "worker", "--pool", "threads", "--concurrency", "64",
           "--include", "celery_stages,pipeline", "--without-mingle", "--without-gossip", "--hostname", node,
           "--loglevel", "INFO"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support"), str(tmp)])}
    out = log.open("ab")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _wait_ready(proc: subprocess.Popen, node: str, log: Path) -> None:
    def pong() -> Any:
        if proc.poll() is not None:
            raise AssertionError(f"the celery worker exited with {proc.returncode}:\n{log.read_text()}")
        return app.control.ping(destination=[node], timeout=0.5)

    wait_for(pong, 60, "the celery worker to answer a ping", every=0.2)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # warm shutdown: running tasks finish first
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def gpu_worker(model_dir: Path) -> Iterator[ThreadWorker]:
    """The Sluice worker on the tiny model, room for all 50 sequences in one running batch."""
    from sluice.engine.llm import LLM

    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=64, kv_cache_memory=8 << 20)
    w = ThreadWorker(llm, queue="tiny")
    try:
        yield w
    finally:
        w.join()


def readme_python() -> list[str]:
    """The Python blocks of the Celery section (docs/deployment.md): the stages module, then the client."""
    text = (ROOT / "docs" / "deployment.md").read_text().split("\n## Celery\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))


def stages(*names: str) -> Any:
    """A chain of test stages by task name (this process need not know the task)."""
    return chain(*(app.signature("test.stage", args=(n,)) for n in names))


# ---- the module itself ---------------------------------------------------------------------------
def test_import_loads_no_engine_and_connects_to_nothing() -> None:
    # The beat schedule is read there too: reading app.conf resolves the broker URL, which here (no
    # SLUICE_REDIS_URL, no module server yet) would start an embedded server and leave it running.
    code = ("import sys, sluice.jobs.celery_app as c; "
            "assert not {'torch', 'engine', 'worker'} & set(sys.modules), sorted(sys.modules); "
            "print(sorted(n for n in c.app.tasks if n.startswith('sluice.'))); "
            "e = c.app.conf.beat_schedule['sluice-housekeeping']; print(e['task'], e['schedule'] > 0)")
    env = {**os.environ, "SLUICE_REDIS_URL": "redis://127.0.0.1:1/0"}  # nothing listens there
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['sluice.generate', 'sluice.housekeep', 'sluice.submit_batch']",
                                       "sluice.housekeep True"]


# ---- sluice.generate -----------------------------------------------------------------------------
def test_fifty_concurrent_generates_run_as_one_continuous_batch(stack: Stack, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    with gpu_worker(tiny_model_dir) as w:
        calls = []
        for i in range(50):  # half plain prompts, half chat
            text = words(rng)
            fields: dict[str, Any] = {"prompt": text} if i % 2 else {"messages": [{"role": "user", "content": text}]}
            calls.append(tasks.generate.delay(**fields, model="tiny", max_tokens=8, ignore_eos=True))
        t0 = time.monotonic()
        outs = [c.get(timeout=120) for c in calls]
        stats = w.worker.llm.stats
    print(f"50 generates in {time.monotonic() - t0:.1f}s; engine stats {stats}")
    for c, out in zip(calls, outs, strict=True):
        assert out["status"] == "completed" and out["custom_id"] == c.id, out
        assert out["usage"]["completion_tokens"] == 8 and isinstance(out["text"], str)
        assert out["worker"] == w.worker.id
        assert not stack.r.exists(keys.meta(batch_id_for(c.id)))  # the forwarded job's batch is dropped once read
    assert stats["max_running"] > 1, f"the engine never ran two sequences at once: {stats}"


@pytest.mark.parametrize("terminate", [False, True], ids=["revoke", "revoke-terminate"])
def test_revoking_a_pending_generate_cancels_its_job(stack: Stack, terminate: bool) -> None:
    r = stack.r
    call = tasks.generate.delay(prompt="the weir holds the river", model="tiny", max_tokens=4)
    bid = batch_id_for(call.id)
    # No Sluice worker is live: the job waits in the stream while the task blocks on its result.
    wait_for(lambda: r.hget(keys.meta(bid), "status") == "in_progress", 30, "the job to be queued")
    wait_for(lambda: call.state == "STARTED", 10, "the task to start")
    assert queue_depth(r, "tiny") >= 1
    call.revoke(terminate=terminate)
    wait_for(lambda: get_batch(r, bid).status == "cancelled", 15, f"the job to be cancelled\n{stack.log_tail()}")
    with pytest.raises(TaskRevokedError):
        call.get(timeout=15)
    assert call.state == "REVOKED"
    (entry,) = assert_exactly_once(r, bid, 1)
    assert entry["status"] == "cancelled"
    assert keys.jobs(bid, 0) not in r.zrange(keys.active_streams("tiny"), 0, -1)


def test_generate_times_out_and_cancels_its_job_and_rejects_bad_requests(stack: Stack) -> None:
    r = stack.r
    call = tasks.generate.delay(prompt="a mill by the bank", model="tiny", timeout=1.5)
    with pytest.raises(GenerationTimeout):
        call.get(timeout=30)
    assert get_batch(r, batch_id_for(call.id)).status == "cancelled"
    bad = tasks.generate.delay(prompt="x", messages=[{"role": "user", "content": "y"}], model="tiny")
    with pytest.raises(ValueError, match="exactly one of"):
        bad.get(timeout=30)
    assert not r.exists(keys.meta(batch_id_for(bad.id)))


# ---- sluice.submit_batch and its completion signature --------------------------------------------
def test_completion_chain_fires_once_after_the_last_result(stack: Stack, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    r = stack.r
    lines = prompt_lines(30, rng, max_tokens=6)
    with gpu_worker(tiny_model_dir):
        bid = tasks.submit_batch.delay(lines=lines, model="tiny", on_complete=stages("filter", "dedupe")).get(timeout=30)
        wait_for(lambda: len(fired(r, bid)) >= 2, 90, f"both stages to run\n{stack.log_tail()}")
    time.sleep(SETTLE)
    runs = fired(r, bid)
    assert [x["stage"] for x in runs] == ["filter", "dedupe"], runs
    assert all(x["status"] == "completed" and x["results"] == x["total"] == 30 for x in runs), runs
    assert_exactly_once(r, bid, 30)
    # Retirement repeated (housekeeping's retry, another process) sends nothing more.
    retire_batch(r, bid)
    r.delete(keys.housekeeping_lock())
    tasks.housekeep.delay(every=0.5).get(timeout=30)
    time.sleep(SETTLE)
    assert len(fired(r, bid)) == 2


def test_completion_signature_fires_however_the_batch_ends(stack: Stack, tmp_path: Path) -> None:
    """Cancelled, failed (no valid line, read from a path) and expired (by the beat housekeeping task)."""
    rng = random.Random(fresh_seed())
    r = stack.r
    lines = prompt_lines(5, rng)
    cancelled = tasks.submit_batch.delay(lines=lines, model="tiny", on_complete=stages("cancelled")).get(timeout=30)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\nnot json\n')
    failed = tasks.submit_batch.delay(path=str(bad), model="tiny", on_complete=stages("failed")).get(timeout=30)
    expired = tasks.submit_batch.delay(lines=lines, model="tiny", completion_window=0.5,
                                 on_complete=stages("expired")).get(timeout=30)
    cancel_batch(r, cancelled)
    time.sleep(0.6)
    r.delete(keys.housekeeping_lock())  # a Sluice worker of an earlier test may have run it just now
    report = tasks.housekeep.delay(every=0.5).get(timeout=30)
    assert report is not None and report["expired_batches"] >= 1, report
    ends = ((cancelled, "cancelled", 5), (failed, "failed", 0), (expired, "expired", 5))
    for bid, status, _ in ends:
        wait_for(lambda bid=bid: fired(r, bid), 15, f"the {status} batch's stage\n{stack.log_tail()}")
    time.sleep(SETTLE)
    for bid, status, total in ends:
        (run,) = fired(r, bid)
        assert run["status"] == status and run["results"] == run["total"] == total, run


def test_racing_retirers_queue_the_signature_once_and_only_after_every_outcome(stack: Stack) -> None:
    rng = random.Random(fresh_seed())
    r = stack.r
    s = Scripts(r)
    sig = dict(app.signature("test.stage", args=("raced",)))
    bid = submit(prompt_lines(4, rng), r=r, model="tiny", on_complete=sig).id
    # Expired, but its sweep not run yet: final without every outcome, so retiring must not fire.
    transition(s, bid, "expired", "expired_at", time.time(), ("in_progress",))
    retire_batch(r, bid)
    assert r.hget(keys.meta(bid), "on_complete_queued_at") is None
    sweep(s, bid, [0, 1, 2, 3], "expired", "batch_expired", "the batch expired", time.time())
    # Every outcome in: eight processes retire it at once (finisher, cancellers, housekeeping).
    gate = threading.Barrier(8)

    def retire() -> None:
        client = connect()
        gate.wait()
        retire_batch(client, bid)
        client.close()

    threads = [threading.Thread(target=retire) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    wait_for(lambda: fired(r, bid), 15, f"the stage to run\n{stack.log_tail()}")
    time.sleep(SETTLE)
    (run,) = fired(r, bid)
    assert run["status"] == "expired" and run["results"] == 4, run
    assert not r.llen(keys.completions()), "the sender left completions unsent"


# ---- the docs' worked example (docs/deployment.md) --------------------------------------------------------------
def test_the_readme_example_runs(stack: Stack, tiny_model_dir: Path) -> None:
    _, client = readme_python()
    out = stack.tmp / "unique.jsonl"
    assert '"unique.jsonl"' in client
    code = client.replace('"unique.jsonl"', repr(str(out)))  # where the Celery worker writes it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(stack.tmp)])}
    with gpu_worker(tiny_model_dir):
        run = subprocess.run([sys.executable, "-c", code], cwd=stack.tmp, env=env, capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        bid = re.search(r"^queued (\S+)$", run.stdout, re.M)[1]
        wait_for(out.exists, 90, f"the pipeline's last stage to write {out}\n{stack.log_tail()}")
    batch = get_batch(stack.r, bid)
    assert batch.status == "completed" and batch.counts.completed == 100
    texts = [json.loads(x)["text"] for x in out.read_text().splitlines()]
    assert texts and len(texts) == len(set(texts)) and all(len(t) > 20 for t in texts)
