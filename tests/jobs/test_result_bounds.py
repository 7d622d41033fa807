"""Bounds on what one request can make a worker write (issue 40, item 2): at most 2,048 embedding inputs
per request or line; a result over SLUICE_MAX_RESULT_BYTES fails its job alone (``result_too_large``); a
write the job server refuses for itself (an error reply, or the connection dropped on that write while
PING answers, as past proto-max-bulk-len) fails its job alone (``result_refused``) instead of being
retried forever as if the server were down. On the embedded Valkey, with a real ``sluice serve`` and a
real ``python -m sluice.worker`` on a tiny random BERT, wide enough (256 dimensions) that 2,048 inputs
make a 2.8 MB result."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from cli_api_helpers import WORDS, sluice_home, start_sluice, stop, wait_for_url
from helpers import fresh_seed, smollm2_tokenizer, write_st_files
from jobs_helpers import ROOT, assert_exactly_once, wait_for
from reliability_helpers import final, pending
from sluice.jobs import keys
from sluice.jobs.connection import connect
from sluice.jobs.consumer import commands
from sluice.jobs.consumer.outbox import WriteHeld, Writer
from sluice.jobs.embeddings import MAX_INPUTS, decode_base64
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.schemas import Result
from sluice.jobs.scripts import Scripts
from sluice.jobs.store import list_workers
from sluice.jobs.submit import submit

pytest_plugins = ["jobs_fixtures"]

KEY = "sk-bounds"
BERT = "widebert"
DIMS = 256  # base64 float32: 1,371 bytes of result per input
MAX_RESULT = 2 << 20  # the worker's SLUICE_MAX_RESULT_BYTES here: 2,048 inputs (2.8 MB) are over it
SMALL_BULK = 1 << 20  # the server's proto-max-bulk-len in the refusal test: 1,200 inputs (1.6 MB) are over it


def _texts(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(n)]


def _line(custom_id: str, inp: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": BERT, "input": inp, "encoding_format": "base64"}})


# ---- the cap on inputs, no model --------------------------------------------------------------
def test_more_than_2048_inputs_is_a_bad_line_alone(r: redis.Redis) -> None:
    many = ["a"] * (MAX_INPUTS + 1)
    with pytest.raises(LineError, match=r"input has 2049 items; at most 2048 per request") as e:
        parse_line(_line("x", many), 4)
    assert (e.value.line, e.value.code) == (4, "invalid_request")
    with pytest.raises(LineError, match="at most 2048"):
        parse_line(json.dumps({"input": [[1, 2]] * (MAX_INPUTS + 1)}), 1)  # token id lists count alike
    assert len(parse_line(_line("x", ["a"] * MAX_INPUTS), 1).input or []) == MAX_INPUTS
    assert len(parse_line(json.dumps({"input": list(range(5000))}), 1).input or []) == 5000  # one input of ids

    b = submit([_line("a", "x"), _line("b", many), _line("c", ["y", "z"])], r=r, model=BERT)
    assert (b.counts.total, b.counts.invalid) == (2, 1)
    assert [(e.line, e.code) for e in b.errors] == [(2, "invalid_request")] and "2048" in b.errors[0].message


# ---- the writer against the real server, no worker --------------------------------------------
def _held_jobs(r: redis.Redis, lines: list[str]) -> tuple[str, list[commands.Delivery]]:
    """A batch of ``lines``, every job read by consumer "w" (pending under it, as a worker holds them)."""
    b = submit(lines, r=r, model="q")
    got = commands.read(r, "q", "w", len(lines), commands.ready(r, "q"))
    assert len(got.deliveries) == len(lines)
    return b.id, got.deliveries


def _outcome(d: commands.Delivery, text: str, status: str = "completed", dead_json: str = "") -> commands.Outcome:
    res = Result(job_id=d.job.id, custom_id=d.job.custom_id, batch_id=d.batch_id, idx=d.job.idx, status=status,
                 text=text)
    return commands.Outcome(d.batch_id, d.job.idx, status, res.model_dump_json(exclude_none=True), d.stream,
                            d.entry_id, dead_json)


def _by_idx(r: redis.Redis, batch_id: str, n: int) -> dict[int, dict[str, Any]]:
    return {e["idx"]: e for e in assert_exactly_once(r, batch_id, n)}


def _fails_first(times: int, real: Any) -> Any:
    """``real`` (a client's own command), whose first ``times`` calls fail as a reset connection does."""
    calls = []

    def call(*args: Any, **kw: Any) -> Any:
        calls.append(1)
        if len(calls) <= times:
            raise redis.ConnectionError("injected: Connection reset by peer")
        return real(*args, **kw)
    return call


def test_a_write_the_server_drops_fails_that_job_alone(r: redis.Redis) -> None:
    """proto-max-bulk-len at 1 MiB: the server refuses each 2 MiB result's write (an error reply, or the
    connection dropped while PING answers: which one depends on timing). Those jobs fail (result_refused),
    the others are written, nothing stays held, nothing is retried forever."""
    rng = random.Random(fresh_seed())
    n = 41
    bigs = set(rng.sample(range(n), 3))
    bid, ds = _held_jobs(r, [json.dumps({"prompt": f"p{i}"}) for i in range(n)])
    w = Writer()
    for d in ds:
        w.add(_outcome(d, "x" * (2 << 20) if d.job.idx in bigs else f"text {d.job.idx}"))
    r.config_set("proto-max-bulk-len", SMALL_BULK)
    try:
        w.flush(r, Scripts(r), time.time())
    finally:
        r.config_set("proto-max-bulk-len", 512 << 20)
    assert len(w) == 0 and pending(r, bid) == 0 and final(r, bid)
    entries = _by_idx(r, bid, n)
    for i in bigs:
        assert entries[i]["status"] == "failed" and entries[i]["error"]["code"] == "result_refused"
        assert re.search("dropped the connection|invalid bulk length", entries[i]["error"]["message"])
        assert entries[i]["custom_id"] == f"line-{i + 1}"
    assert all((entries[i]["status"], entries[i]["text"]) == ("completed", f"text {i}") for i in range(n) if i not in bigs)


def test_one_failed_ping_after_a_dropped_write_is_not_an_outage(r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The PING that tells a dropped write from an outage fails once (as one did on a loaded CI machine):
    the writer asks again and fails that job alone instead of holding every result as if the server were
    down. A server that fails both PINGs is down: the outcome stays held."""
    bid, ds = _held_jobs(r, [json.dumps({"prompt": f"p{i}"}) for i in range(2)])
    ping = r.ping
    w = Writer()
    w.add(_outcome(ds[0], "x" * (2 << 20)))
    r.config_set("proto-max-bulk-len", SMALL_BULK)
    try:
        monkeypatch.setattr(r, "ping", _fails_first(2, ping))  # down: both PINGs fail
        with pytest.raises(redis.ConnectionError):
            w.flush(r, Scripts(r), time.time())
        assert len(w) == 1 and r.hlen(keys.done(bid)) == 0
        monkeypatch.setattr(r, "ping", _fails_first(1, ping))
        w.add(_outcome(ds[1], "small"))
        w.flush(r, Scripts(r), time.time())
    finally:
        r.config_set("proto-max-bulk-len", 512 << 20)
    assert len(w) == 0 and pending(r, bid) == 0
    entries = _by_idx(r, bid, 2)
    assert entries[0]["status"] == "failed" and entries[0]["error"]["code"] == "result_refused"
    assert (entries[1]["status"], entries[1]["text"]) == ("completed", "small")


def test_a_write_dropped_once_is_written_again_not_failed(r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection dropped under one ordinary write while the server answers PING (a server restarted
    under the write, as chaos.py's kill -9 of Valkey does) is written again, not failed as refused: that
    takes the same write dropped twice."""
    from sluice.jobs import pipes

    bid, ds = _held_jobs(r, [json.dumps({"prompt": f"p{i}"}) for i in range(3)])
    real, drops = pipes.NodePipes.execute, []

    def drop_once(self: pipes.NodePipes) -> list[Any]:
        if len(drops) < 2:  # the chunk's round trip, then the first outcome's alone: neither reaches the server
            drops.append(len(self))
            return [redis.ConnectionError("injected: Connection reset by peer")] * len(self)
        return real(self)

    monkeypatch.setattr(pipes.NodePipes, "execute", drop_once)
    w = Writer()
    for d in ds:
        w.add(_outcome(d, f"text {d.job.idx}"))
    w.flush(r, Scripts(r), time.time())
    assert drops == [3, 1] and len(w) == 0 and pending(r, bid) == 0
    entries = _by_idx(r, bid, 3)
    assert all((entries[i]["status"], entries[i]["text"]) == ("completed", f"text {i}") for i in range(3))


def test_an_outcome_stays_held_when_the_round_trips_after_its_refused_write_fail(
        r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server drops a 2 MiB write, PING answers, then the next round trip (does its batch still
    exist?) fails. Once: it is asked again and the job fails alone (result_refused), no outage. Twice: the
    server is taken for down and the outcome is still in the outbox, not lost from it (on CI it was, and
    the job ran a second time once the worker reclaimed it); the next flush fails it alone."""
    bid, ds = _held_jobs(r, [json.dumps({"prompt": f"p{i}"}) for i in range(2)])
    exists = r.exists
    w = Writer()
    r.config_set("proto-max-bulk-len", SMALL_BULK)
    try:
        monkeypatch.setattr(r, "exists", _fails_first(1, exists))
        w.add(_outcome(ds[0], "x" * (2 << 20)))
        w.flush(r, Scripts(r), time.time())
        assert len(w) == 0
        monkeypatch.setattr(r, "exists", _fails_first(2, exists))
        w.add(_outcome(ds[1], "x" * (2 << 20)))
        with pytest.raises(redis.ConnectionError, match="injected"):
            w.flush(r, Scripts(r), time.time())
        assert len(w) == 1 and w.entry_ids() == {ds[1].entry_id}
        w.flush(r, Scripts(r), time.time())
    finally:
        r.config_set("proto-max-bulk-len", 512 << 20)
    assert len(w) == 0 and pending(r, bid) == 0
    entries = _by_idx(r, bid, 2)
    assert all(entries[i]["status"] == "failed" and entries[i]["error"]["code"] == "result_refused" for i in (0, 1))


def test_an_error_reply_for_one_write_fails_that_job_alone_and_full_holds_all(r: redis.Redis) -> None:
    """An error reply that is about this write (WRONGTYPE: the dead-letter stream of a batch is a string)
    is not retried: the job keeps one outcome, the rest are written. A full server (OOM) refuses every
    write for now: everything is held (WriteHeld) and written once memory frees."""
    bid, ds = _held_jobs(r, [json.dumps({"prompt": f"p{i}"}) for i in range(5)])
    r.set(keys.dead(bid), "not a stream")
    w = Writer()
    for d in ds:
        dead = json.dumps({"idx": 2, "error": "boom"}) if d.job.idx == 2 else ""
        w.add(_outcome(d, f"text {d.job.idx}", "failed" if dead else "completed", dead))
    w.flush(r, Scripts(r), time.time())
    assert len(w) == 0 and pending(r, bid) == 0
    entries = _by_idx(r, bid, 5)
    assert entries[2]["status"] == "failed" and [entries[i]["status"] for i in (0, 1, 3, 4)] == ["completed"] * 4

    bid, ds = _held_jobs(r, [json.dumps({"prompt": f"p{i}"}) for i in range(3)])
    for d in ds:
        w.add(_outcome(d, "t"))
    r.config_set("maxmemory", 1)
    try:
        with pytest.raises(WriteHeld, match="OutOfMemoryError"):
            w.flush(r, Scripts(r), time.time())
        assert len(w) == 3 and r.hlen(keys.done(bid)) == 0
    finally:
        r.config_set("maxmemory", 0)
    w.flush(r, Scripts(r), time.time())
    assert len(w) == 0 and all(e["status"] == "completed" for e in _by_idx(r, bid, 3).values())


# ---- a real API and a real worker ---------------------------------------------------------------
@dataclass
class Live:
    url: str
    worker: subprocess.Popen
    log: Path

    def post(self, inp: Any) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                          json={"model": BERT, "input": inp, "encoding_format": "base64"})


@pytest.fixture(scope="module")
def wide_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 1-layer random BERT of 256 dimensions (SmolLM2's tokenizer), mean pooling, normalised."""
    import torch
    from transformers import BertConfig, BertModel

    path = tmp_path_factory.mktemp("wide-bert") / "model"
    cfg = BertConfig(vocab_size=49152, hidden_size=DIMS, num_hidden_layers=1, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64)
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(path)
    smollm2_tokenizer().save_pretrained(path)
    write_st_files(path, "mean", max_len=32)
    return path


@pytest.fixture(scope="module")
def live(wide_bert: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """``sluice serve`` and ``python -m sluice.worker`` on the wide BERT, its results capped at 2 MiB."""
    home = tmp_path_factory.mktemp("bounds") / "home"
    with sluice_home(home):
        log = home.parent / "worker.log"
        env = {**os.environ, "SLUICE_MAX_RESULT_BYTES": str(MAX_RESULT)}
        worker = subprocess.Popen([sys.executable, "-m", "sluice.worker", "--model", str(wide_bert), "--queue", BERT,
                                   "--worker-id", "wide", "--heartbeat-ttl", "2"], cwd=ROOT, env=env,
                                  stdout=log.open("ab"), stderr=subprocess.STDOUT)
        serve_log = home.parent / "serve.log"
        proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=serve_log,
                            env={**os.environ, "SLUICE_API_KEY": KEY})
        try:
            url = wait_for_url(proc, serve_log, timeout=60)
            r = connect()
            wait_for(lambda: worker.poll() is not None or any(w.queue == BERT for w in list_workers(r)), 180,
                     "the worker's heartbeat")
            assert worker.poll() is None, log.read_text()[-3000:]
            yield Live(url, worker, log)
        finally:
            assert stop(proc) == 0, serve_log.read_text()[-3000:]
            worker.send_signal(2)
            try:
                worker.wait(60)
            finally:
                worker.kill()


def _vectors(body: dict[str, Any], n: int) -> None:
    assert [d["index"] for d in body["data"]] == list(range(n))
    assert all(len(decode_base64(d["embedding"])) == DIMS for d in body["data"])


def _left_behind(r: redis.Redis) -> list[str]:
    return [k for k in r.scan_iter(match=f"{keys.PREFIX}:*{{req_*")] + list(r.zrange(keys.interactive(BERT), 0, -1))


def _assert_serving(live: Live, rng: random.Random) -> None:
    """The worker is alive, its heartbeat on, and a later request is answered."""
    ok = live.post(_texts(rng, 3))
    assert ok.status_code == 200, ok.text
    _vectors(ok.json(), 3)
    assert live.worker.poll() is None
    assert any(w.id == "wide" and w.writes_held_since is None for w in list_workers(connect()))


def test_online_over_2048_inputs_is_400_and_a_result_too_large_fails_alone(live: Live) -> None:
    rng = random.Random(fresh_seed())
    r = connect()
    over = live.post(_texts(rng, MAX_INPUTS + 1))
    assert over.status_code == 400, over.text
    assert over.json()["error"]["code"] == "invalid_request" and "at most 2048" in over.json()["error"]["message"]

    big = live.post(_texts(rng, MAX_INPUTS))  # 2.8 MB of vectors, over the worker's 2 MiB
    assert big.status_code == 400, big.text
    err = big.json()["error"]
    assert err["code"] == "result_too_large" and "at most 2.0 MiB (SLUICE_MAX_RESULT_BYTES)" in err["message"]
    _assert_serving(live, rng)
    assert _left_behind(r) == []


def test_batch_result_too_large_fails_that_job_alone(live: Live) -> None:
    rng = random.Random(fresh_seed())
    r = connect()
    n = 12
    big = rng.randrange(n)
    sizes = [MAX_INPUTS if i == big else rng.randint(1, 40) for i in range(n)]
    lines = [_line(f"e{i}", _texts(rng, k)) for i, k in enumerate(sizes)]
    lines.insert(rng.randrange(n), _line("over", ["a"] * (MAX_INPUTS + 1)))
    b = submit(lines, r=r, model=BERT)
    assert b.counts.total == n and [e.code for e in b.errors] == ["invalid_request"]
    wait_for(lambda: final(r, b.id), 180, "the batch to finish")
    entries = {e["custom_id"]: e for e in assert_exactly_once(r, b.id, n)}
    assert entries[f"e{big}"]["status"] == "failed"
    assert entries[f"e{big}"]["error"]["code"] == "result_too_large"
    for i in range(n):
        if i != big:
            assert entries[f"e{i}"]["status"] == "completed", entries[f"e{i}"]
            assert [len(decode_base64(v)) for v in entries[f"e{i}"]["embeddings"]] == [DIMS] * sizes[i]
    assert pending(r, b.id) == 0
    _assert_serving(live, rng)


def test_a_result_the_server_drops_fails_alone_and_the_worker_serves_on(live: Live) -> None:
    """The server's proto-max-bulk-len lowered to 1 MiB: a 1.6 MB result (under the worker's 2 MiB) is
    dropped on its write while PING answers. That job fails (result_refused), the batch's others
    complete, the worker never takes the server for down, and serves the next request."""
    rng = random.Random(fresh_seed())
    r = connect()
    n = 10
    big = rng.randrange(n)
    sizes = [1200 if i == big else rng.randint(1, 40) for i in range(n)]
    b = submit([_line(f"e{i}", _texts(rng, k)) for i, k in enumerate(sizes)], r=r, model=BERT)
    r.config_set("proto-max-bulk-len", SMALL_BULK)
    try:
        wait_for(lambda: final(r, b.id), 180, "the batch to finish")
    finally:
        r.config_set("proto-max-bulk-len", 512 << 20)
    entries = {e["custom_id"]: e for e in assert_exactly_once(r, b.id, n)}
    assert entries[f"e{big}"]["status"] == "failed" and entries[f"e{big}"]["error"]["code"] == "result_refused"
    assert all(entries[f"e{i}"]["status"] == "completed" for i in range(n) if i != big)
    assert pending(r, b.id) == 0
    _assert_serving(live, rng)
    assert "Redis unreachable" not in live.log.read_text()


def test_writes_held_on_a_batch_the_server_refuses_show_in_the_heartbeat(live: Live) -> None:
    """A batch whose results stream is not a stream (WRONGTYPE for its result and for the small failed one
    in its place): its outcomes are held, the heartbeat says since when and why, other requests are
    answered meanwhile; once the key is mended the held outcomes are written, each job once."""
    rng = random.Random(fresh_seed())
    r = connect()
    live.worker.send_signal(signal.SIGSTOP)  # the key is broken before the worker can take the jobs
    try:
        b = submit([_line(f"e{i}", _texts(rng, 2)) for i in range(3)], r=r, model=BERT)
        r.set(keys.results(b.id), "not a stream")
    finally:
        live.worker.send_signal(signal.SIGCONT)
    beat = wait_for(lambda: next((w for w in list_workers(r) if w.id == "wide" and w.writes_held_since is not None), None),
                    120, "the heartbeat to say results are held")
    assert "WRONGTYPE" in beat.write_error and beat.unwritten >= 1
    ok = live.post(_texts(rng, 2))  # the worker serves on
    assert ok.status_code == 200, ok.text
    assert r.hlen(keys.done(b.id)) == 0
    r.delete(keys.results(b.id))
    wait_for(lambda: final(r, b.id), 60, "the held outcomes to be written")
    entries = assert_exactly_once(r, b.id, 3)
    assert all(e["status"] == "failed" and e["error"]["code"] == "result_refused" for e in entries)
    assert pending(r, b.id) == 0
    wait_for(lambda: any(w.id == "wide" and w.writes_held_since is None for w in list_workers(r)), 30,
             "the heartbeat to say nothing is held")
