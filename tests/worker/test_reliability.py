"""The job plane under faults (issue 11): one regression test per hole found by fault injection,
each against the real embedded Valkey. Every test checks that each job got exactly one outcome."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import redis
from held_engine import HeldLLM
from helpers import fresh_seed
from jobs_helpers import ThreadWorker, assert_exactly_once, prompt_lines, result_entries, wait_for
from paced import PacedLLM
from reliability_helpers import final, pending, run_to_end, tiny
from sluice.engine.llm import LLM
from sluice.jobs import keys
from sluice.jobs.housekeeping import housekeep
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.scripts import Scripts, requeue
from sluice.jobs.store import cancel_batch, dead_letters, expire_batch, get_batch, queue_depth, read_results
from sluice.jobs.submit import _Submission, submit

pytest_plugins = ["jobs_fixtures"]



# ---- 1. more job streams than one read looks at --------------------------------------------------
def test_more_streams_than_a_read_looks_at_all_get_delivered(r: redis.Redis, tiny_model_dir: Path) -> None:
    """A batch with 300 priorities (300 streams, more than the 256 a read looks at), and one-job batches
    behind it: drained streams must not hide the rest."""
    big = submit([json.dumps({"custom_id": f"p{i}", "prompt": "a b", "max_tokens": 1, "priority": i})
                  for i in range(300)], r=r, model="tiny")
    ones = [submit([json.dumps({"prompt": "c d", "max_tokens": 1})], r=r, model="tiny", priority=-5)
            for _ in range(20)]
    w = ThreadWorker(tiny(tiny_model_dir, max_num_seqs=32))
    try:
        wait_for(lambda: final(r, big.id) and all(final(r, b.id) for b in ones), 90, "every batch to finish")
    finally:
        w.join()
    assert_exactly_once(r, big.id, 300)
    assert all(get_batch(r, b.id).status == "completed" for b in ones)
    assert queue_depth(r, "tiny") == 0


def test_housekeeping_puts_back_a_stream_whose_ready_mark_was_lost(r: redis.Redis) -> None:
    """A ZADD to the ready set refused (Redis full) or lost with the last second of AOF: housekeeping
    puts the stream back while it holds undelivered jobs, and only then."""
    b = submit([json.dumps({"prompt": f"p{i}"}) for i in range(3)], r=r, model="q")
    stream = keys.jobs(b.id, 0)
    r.zrem(keys.ready_streams("q"), stream)
    housekeep(r)
    assert r.zscore(keys.ready_streams("q"), stream) is not None
    r.xreadgroup(keys.GROUP, "w", {stream: ">"}, count=3)  # all delivered: nothing left to read
    r.zrem(keys.ready_streams("q"), stream)
    housekeep(r)
    assert r.zscore(keys.ready_streams("q"), stream) is None


# ---- 2. batches that stayed "validating" forever ---------------------------------------------------
def test_non_finite_and_out_of_range_numbers_are_bad_lines(r: redis.Redis) -> None:
    lines = ['{"prompt": "x", "deadline": NaN}', '{"prompt": "x", "priority": 1e300}',
             '{"prompt": "x", "deadline": Infinity}', json.dumps({"prompt": "ok"})]
    b = submit(lines, r=r, model="q")
    assert b.status == "in_progress" and (b.counts.total, b.counts.invalid) == (1, 3)
    assert [e.line for e in b.errors] == [1, 2, 3]


def test_housekeeping_seals_batches_whose_submitter_died(r: redis.Redis) -> None:
    """The submitter dies mid-upload (no finalize): housekeeping seals what was queued, and a cancel
    that came meanwhile finishes instead of staying "cancelling"."""
    subs = []
    for n in (3, 2, 0):
        sub = _Submission(r, keys.new_batch_id(), "q", None, 0, 100)
        sub.create(3600.0, None, None)
        for i in range(n):
            sub.add(i + 1, json.dumps({"prompt": f"p{i}"}))
        sub.flush()
        sub.wait()
        subs.append(sub)
    assert cancel_batch(r, subs[1].bid).status == "cancelling"
    housekeep(r, now=time.time() + 3000)
    kept, cancelled, empty = (get_batch(r, s.bid) for s in subs)
    assert kept.status == "in_progress" and kept.counts.total == 3
    assert cancelled.status == "cancelled" and cancelled.counts.cancelled == 2
    assert empty.status == "failed"
    assert r.zscore(keys.open_batches(), cancelled.id) is None


def test_housekeeping_reaches_past_the_first_thousand_open_batches(r: redis.Redis) -> None:
    now = time.time()
    pipe = r.pipeline(transaction=False)
    for i in range(1001):
        bid = f"batch_hk{i:05d}"
        pipe.hset(keys.meta(bid), mapping={"id": bid, "status": "in_progress", "model": "q", "created_at": now + i,
                                           "expires_at": now + 3600, "total": 0, "sealed": 1, "touched_at": now})
        pipe.zadd(keys.open_batches(), {bid: now + i})
    pipe.hset(keys.meta("batch_hk01000"), "expires_at", now - 1)  # the newest, 1001st
    pipe.execute()
    housekeep(r, now=now + 1)
    assert r.hget(keys.meta("batch_hk01000"), "status") == "expired"


# ---- 3. results dropped on error replies; Redis full -----------------------------------------------
def test_redis_full_holds_results_and_refuses_submission_cleanly(r: redis.Redis, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 40
    b = submit(prompt_lines(n, rng, max_tokens=6), r=r, model="tiny")
    llm = tiny(tiny_model_dir, HeldLLM, max_num_seqs=4)
    llm.hold_when(lambda: llm.completed >= 4)  # Redis fills with 36 jobs still to run, however fast the machine
    w = ThreadWorker(llm, lookahead=2, heartbeat_ttl=30.0)
    try:
        wait_for(lambda: llm.is_held and r.hlen(keys.done(b.id)) >= 4, 60, "some results")
        r.config_set("maxmemory", 1)  # every write that needs memory is refused (OOM) from now
        llm.release()
        try:
            wait_for(lambda: len(w.worker.session.outbox) >= 3, 60, "results held while Redis is full")
            written = r.hlen(keys.done(b.id))
            with pytest.raises(redis.ResponseError, match="job server is full"):
                submit(prompt_lines(3, rng), r=r, model="tiny")
            time.sleep(1.0)  # the held results are retried meanwhile, and refused
            assert r.hlen(keys.done(b.id)) == written and len(w.worker.session.outbox) >= 3
        finally:
            r.config_set("maxmemory", 0)
        wait_for(lambda: final(r, b.id), 60, "the batch to finish once memory frees")
    finally:
        llm.release()
        w.join()
    entries = assert_exactly_once(r, b.id, n)
    assert all(e["status"] == "completed" for e in entries) and dead_letters(r, b.id) == []
    assert pending(r, b.id) == 0
    assert [x for x in r.scan_iter(match="sluice:{batch_*") if b.id not in x] == []  # the refused batch left nothing


# ---- 5. parameters that validate but crash every step -------------------------------------------------
@pytest.mark.parametrize("extra", [{"top_k": 2**63}, {"seed": 2**64}, {"stop": ["x"] * 100_000},
                                   {"stop_token_ids": [-1]}, {"temperature": float("nan")},
                                   {"max_tokens": 10**12}])
def test_numbers_and_lists_are_bounded(extra: dict[str, Any]) -> None:
    with pytest.raises(LineError):
        parse_line(json.dumps({"prompt": "x", **extra}), 1)


def test_a_stop_token_outside_the_vocabulary_fails_only_its_job(r: redis.Redis, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    lines = prompt_lines(6, rng, max_tokens=4)
    lines.append(json.dumps({"custom_id": "bad", "prompt": "a b", "max_tokens": 4, "min_tokens": 2,
                             "stop_token_ids": [10**6]}))
    b = submit(lines, r=r, model="tiny")
    run_to_end(r, b.id, tiny(tiny_model_dir))
    entries = {e["custom_id"]: e for e in assert_exactly_once(r, b.id, 7)}
    assert entries["bad"]["status"] == "failed" and entries["bad"]["error"]["code"] == "invalid_request"
    assert "stop_token_ids" in entries["bad"]["error"]["message"]
    assert sum(e["status"] == "completed" for e in entries.values()) == 6 and dead_letters(r, b.id) == []


# ---- 6. a slow but live worker keeps its jobs; a late one cannot put a taken job back ---------------------
class SlowLLM(LLM):
    """One step, once jobs run, takes ``pause`` seconds (a long prefill, a GC pause, a swap)."""

    pause = 3.0

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.added: list[str] = []
        self.paused = False

    def add_request(self, request: Any) -> None:
        self.added.append(request.request_id.split("#")[0])
        super().add_request(request)

    def step(self) -> Any:
        if not self.paused and self.num_running:
            self.paused = True
            time.sleep(self.pause)
        return super().step()


def test_a_step_longer_than_the_heartbeat_ttl_keeps_the_jobs(r: redis.Redis, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 16
    b = submit(prompt_lines(n, rng, max_tokens=4), r=r, model="tiny")
    slow = tiny(tiny_model_dir, SlowLLM, max_num_seqs=16)
    w1 = ThreadWorker(slow, worker_id="slow", heartbeat_ttl=1.0, lookahead=0)
    wait_for(lambda: slow.paused, 30, "the slow step")
    other = tiny(tiny_model_dir, SlowLLM)
    other.paused = True
    w2 = ThreadWorker(other, worker_id="other", heartbeat_ttl=1.0, claim_interval=0.2)
    try:
        wait_for(lambda: final(r, b.id), 60, "the batch to finish")
    finally:
        reports = [w1.join(), w2.join()]
    assert_exactly_once(r, b.id, n)
    ran = Counter(slow.added + other.added)
    assert len(ran) == n and max(ran.values()) == 1, "a live worker's job ran twice"
    assert reports[1].claimed == 0


def test_a_late_worker_cannot_requeue_a_job_another_took(r: redis.Redis) -> None:
    b = submit([json.dumps({"prompt": "x"})], r=r, model="q")
    stream = keys.jobs(b.id, 0)
    (_, [(eid, fields)]), = r.xreadgroup(keys.GROUP, "late", {stream: ">"}, count=1)
    r.xclaim(stream, keys.GROUP, "taker", 0, [eid])  # the late worker's heartbeat lapsed meanwhile
    put_back = requeue(Scripts(r), stream, eid, fields["j"], 0, "late")
    assert put_back == 0
    assert r.xlen(stream) == 1 and r.xpending(stream, keys.GROUP)["consumers"] == [{"name": "taker", "pending": 1}]


# ---- 7. expiry reported as expiry -------------------------------------------------------------------
def test_expiry_settles_in_flight_jobs_as_expired(r: redis.Redis, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 24
    b = submit(prompt_lines(n, rng, max_tokens=400), r=r, model="tiny")
    llm = tiny(tiny_model_dir, PacedLLM, max_num_seqs=8)  # 1,200 steps: 24 s at the least, so jobs are in flight
    w = ThreadWorker(llm)
    try:
        wait_for(lambda: llm.num_running >= 4, 60, "jobs in flight")
        assert expire_batch(r, b.id)
        # The event names the outcome the workers give what they hold (the sweep races them for it).
        event = r.xrevrange(keys.cancels("tiny"), count=1)[0][1]
        assert (event["b"], event.get("s")) == (b.id, "expired")
        wait_for(lambda: not w.worker.held and r.hlen(keys.done(b.id)) == n, 30, "the worker to drop the batch")
    finally:
        w.join()
    entries = assert_exactly_once(r, b.id, n)
    late = [e for e in entries if e["status"] != "completed"]
    assert late and {e["status"] for e in late} == {"expired"}, Counter(e["status"] for e in late)
    assert get_batch(r, b.id).counts.cancelled == 0


# ---- also: an unreadable job entry gets a failed outcome ---------------------------------------------
def test_an_unreadable_job_entry_fails_with_a_reason(r: redis.Redis, tiny_model_dir: Path) -> None:
    sub = _Submission(r, keys.new_batch_id(), "tiny", None, 0, 100)
    sub.create(3600.0, None, None)
    for i in range(2):
        sub.add(i + 1, json.dumps({"prompt": f"p {i}", "max_tokens": 2}))
    sub.flush()
    sub.wait()
    r.xadd(keys.jobs(sub.bid, 0), {"j": json.dumps({"idx": 2, "custom_id": 7})})  # a corrupt entry
    r.hset(keys.meta(sub.bid), "total", 3)
    sub.total = 3
    sub.finalize()
    run_to_end(r, sub.bid, tiny(tiny_model_dir))
    entries = {e["idx"]: e for e in assert_exactly_once(r, sub.bid, 3)}
    assert entries[2]["status"] == "failed" and entries[2]["error"]["code"] == "unreadable_job"
    assert [e["status"] for i, e in sorted(entries.items()) if i < 2] == ["completed", "completed"]
    assert result_entries(r, sub.bid)


# ---- 9. the Celery completion forwarder outlives a Redis refusal ---------------------------------------
def test_the_completion_forwarder_outlives_redis_refusing_the_put_back(r: redis.Redis,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker refuses a signature and Redis then refuses to take the batch id back (full): the
    forwarder must keep the id, put it back later, and go on sending the ones after it."""
    import sluice.jobs.celery_app as celery_app
    from kombu.exceptions import OperationalError

    refused: list[str] = []
    sent: list[str] = []

    def send(client: Any, batch_id: str) -> None:
        if not refused:
            refused.append(batch_id)
            r.config_set("maxmemory", 1)  # the LPUSH that puts it back now fails
            raise OperationalError("broker unreachable")
        sent.append(batch_id)

    monkeypatch.setattr(celery_app, "send_completion", send)
    monkeypatch.setattr(celery_app, "_redis", lambda: r)
    r.rpush(keys.completions(), "batch_one")
    stop = threading.Event()
    t = threading.Thread(target=celery_app.forward_completions, args=(stop,), daemon=True)
    t.start()
    try:
        wait_for(lambda: refused, 10, "the broker's refusal")
        time.sleep(1.5)  # a put-back or two refused meanwhile
        r.config_set("maxmemory", 0)
        r.rpush(keys.completions(), "batch_two")
        wait_for(lambda: sent == ["batch_one", "batch_two"], 15, "both signatures sent")
    finally:
        r.config_set("maxmemory", 0)
        stop.set()
        t.join(timeout=5)
    assert not t.is_alive() and r.llen(keys.completions()) == 0


# ---- 2 and 3 through the API: a bad number is a 400, a full job server a 507 ---------------------------
def test_the_api_rejects_nan_and_reports_a_full_job_server(r: redis.Redis, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient
    from sluice.api.app import create_app
    from sluice.api.settings import Settings

    c = TestClient(create_app(Settings(api_key=None, files_dir=tmp_path / "files")))
    nan = c.post("/v1/jobs", content=b'{"prompt": "x", "deadline": NaN}', headers={"content-type": "application/json"})
    assert nan.status_code == 400 and "deadline" in nan.json()["error"]["message"]
    assert r.zcard(keys.open_batches()) == 0
    r.config_set("maxmemory", 1)
    try:
        full = c.post("/v1/jobs", json={"prompt": "x"})
    finally:
        r.config_set("maxmemory", 0)
    assert full.status_code == 507 and full.json()["error"]["code"] == "job_server_full"
    assert r.zcard(keys.all_batches()) == 0  # nothing of the refused job was kept


# ---- also: a line that is not UTF-8 is rejected by its number, everywhere -------------------------------
def test_a_line_that_is_not_utf8_is_a_bad_line_in_celery_and_cli_reads(r: redis.Redis, tmp_path: Path) -> None:
    from sluice.jobs.celery_app import _read

    f = tmp_path / "in.jsonl"
    f.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n{"prompt": "also fine"}\n')
    b = submit(_read(f), r=r, model="q")
    assert (b.counts.total, b.counts.invalid) == (2, 1)
    assert (b.errors[0].line, b.errors[0].code) == (2, "invalid_encoding")


# ---- a slow disk or a long housekeeping pass does not hold up outcome writes (issue 21, item 4) -----
class Stall:
    """An injected fault that holds whichever thread reaches it until the test lets go (at most
    ``limit`` seconds): an fsync on a dying disk, a housekeeping pass over thousands of batches."""

    def __init__(self, limit: float = 180.0) -> None:
        self.reached, self.released, self.limit = threading.Event(), threading.Event(), limit

    def hold(self) -> None:
        self.reached.set()
        self.released.wait(self.limit)


def _writes_through_a_stall(r: redis.Redis, model_dir: Path, stall: Stall, **opts: Any) -> None:
    """A batch runs while the fault holds its thread: every result is written while it is still held."""
    n = 24
    b = submit(prompt_lines(n, random.Random(fresh_seed()), max_tokens=2), r=r, model="tiny")
    w = ThreadWorker(tiny(model_dir), **opts)
    try:
        assert stall.reached.wait(120), "the fault was never reached"
        wait_for(lambda: final(r, b.id), 120, "every result written while the fault holds its thread")
        assert not stall.released.is_set()
    finally:
        stall.released.set()
        w.join(timeout=60)
    # Some results may be in files by now: read them as a user would (files, then the stream).
    got = read_results(r, b.id, "0", n + 1).results
    assert sorted(x.idx for x in got) == list(range(n)) and get_batch(r, b.id).counts.completed == n


def test_a_long_housekeeping_pass_does_not_hold_up_writes(r: redis.Redis, tiny_model_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass over thousands of open batches takes seconds (8,000: 2.3 s measured); held here."""
    from sluice.jobs.consumer import upkeep

    stall = Stall()
    monkeypatch.setattr(upkeep, "housekeep_if_due", lambda *a, **kw: stall.hold())
    _writes_through_a_stall(r, tiny_model_dir, stall, housekeeping_interval=0.1)


def test_a_results_disk_whose_fsync_stalls_does_not_hold_up_writes(r: redis.Redis, tiny_model_dir: Path,
                                                                   tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Results spill to files after every result; the disk's fsync hangs until the test lets go."""
    from sluice.jobs import spill

    monkeypatch.setenv("SLUICE_FILES_DIR", str(tmp_path / "files"))
    monkeypatch.setenv("SLUICE_RESULTS_SPILL", "1")
    monkeypatch.setattr(spill, "KEEP", 1)
    stall = Stall()
    real_fsync = spill.os.fsync

    def slow_fsync(fd: int) -> None:
        stall.hold()
        real_fsync(fd)

    monkeypatch.setattr(spill.os, "fsync", slow_fsync)
    _writes_through_a_stall(r, tiny_model_dir, stall)
