"""Dropped streams (issue 40, item 4), on real processes: a ``sluice serve`` (uvicorn, its cycle collector
off, so no cleanup can wait for it), a paced worker
process on the tiny model, and clients that open streamed requests with a large ``max_tokens`` and go
away, each its own way: a FIN once text came, a RST once text came, a FIN once the answer began but
before any text, a client process killed with -9 mid-stream, a client that stops reading (its
small window fills, the API's sends wait) and then resets. Each job must get its one outcome,
cancelled (the worker aborts it: paced, it could not finish in the bound), its keys and admission slot
must go, and no deltas stream may come back after the API deleted it (MONITOR sees every write, a
script's included)."""

from __future__ import annotations

import json
import os
import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from cli_api_helpers import ROOT, WORDS, default_sigint, stop, wait_for_url
from helpers import fresh_seed
from jobs_helpers import wait_for, worker_process
from paced import PACE
from sluice.jobs import keys

pytest_plugins = ["jobs_fixtures", "cluster_fixtures"]

KEY = "sk-sluice-test"
MAX_TOKENS = 3500  # paced, a run takes MAX_TOKENS / PACE = 70 s or more: only a cancel ends it sooner
GONE_BOUND = 30.0  # seconds the test waits for the jobs to be aborted and the keys to go (a hang bound)
MODES = ("fin_after_text", "rst_after_text", "fin_before_text", "killed_client", "stalled_then_rst")
STALL_S = 8.0  # seconds a stalled client reads nothing before it goes: the API's sends back up meanwhile

# A client in its own process (killed with -9 mid-stream): says "text" once text came, then waits.
_CLIENT = """
import json, sys, time, httpx
url, key, body = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with httpx.stream("POST", url, json=body, headers={"Authorization": "Bearer " + key}, timeout=600) as r:
    for line in r.iter_lines():
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
            print("text", flush=True)
            time.sleep(3600)
"""


@dataclass
class Monitor:
    """Every command the server runs (MONITOR), a script's own writes included, in the server's order."""

    client: redis.Redis
    lines: list[str] = field(default_factory=list)

    def run(self) -> None:
        try:
            with self.client.monitor() as m:
                while True:
                    self.lines.append(m.connection.read_response())
        except (redis.ConnectionError, OSError, ValueError):
            pass  # closed at the end of the test

    def commands(self) -> list[tuple[str, list[str]]]:
        """(client: an address or "lua", args) each."""
        out = []
        for line in self.lines:
            m = re.match(r"^\S+ \[\d+ ([^\]]+)\] (.*)$", line)
            if m:
                out.append((m.group(1), re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(2))))
        return out


@contextmanager
def monitored(r: redis.Redis) -> Iterator[Monitor]:
    mon = Monitor(redis.Redis(connection_pool=redis.ConnectionPool(**r.connection_pool.connection_kwargs)))
    t = threading.Thread(target=mon.run, daemon=True)
    t.start()
    wait_for(lambda: r.echo("monitor-ready") and any("monitor-ready" in x for x in mon.lines), 10,
             "MONITOR to start", every=0.1)
    try:
        yield mon
    finally:
        mon.client.connection_pool.disconnect()
        t.join(10)


def _request(path: str, body: dict[str, Any]) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: sluice\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(data)}\r\n\r\n").encode() + data


def _has_text(buf: bytes) -> bool:
    """Whether an event with generated text is among the complete lines of ``buf`` (chunked SSE)."""
    for line in buf.rpartition(b"\n")[0].split(b"\n"):
        if line.startswith(b"data: {"):
            choice = (json.loads(line[6:])["choices"] or [{}])[0]
            if choice.get("text") or (choice.get("delta") or {}).get("content"):
                return True
    return False


def _raw_client(host: str, port: int, path: str, body: dict[str, Any], mode: str, gone: list[str]) -> None:
    """A client on a bare socket that leaves as ``mode`` says."""
    sock = socket.socket()
    if mode == "stalled_then_rst":  # a small window: the API's sends to it back up soon after it stops reading
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.settimeout(120)
    sock.connect((host, port))
    sock.sendall(_request(path, body))
    buf = b""
    while b"\r\n\r\n" not in buf if mode == "fin_before_text" else not _has_text(buf):
        got = sock.recv(65536)
        assert got, f"the stream ended early: {buf[-2000:]!r}"
        buf += got
    assert b" 200 OK" in buf.split(b"\r\n", 1)[0], buf[:500]  # admitted and queued: the stream began
    if mode == "stalled_then_rst":
        time.sleep(STALL_S)  # the stream is held in a send to this client when it goes
    if mode in ("rst_after_text", "stalled_then_rst"):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close sends a RST
    sock.close()
    gone.append(mode)


def _killed_client(url: str, body: dict[str, Any], gone: list[str]) -> None:
    p = subprocess.Popen([sys.executable, "-c", _CLIENT, f"{url}/v1/completions", KEY, json.dumps(body)],
                         stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([p.stdout], [], [], 120)
        assert ready and p.stdout is not None and p.stdout.readline() == b"text\n", "the client got no text"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    gone.append("killed_client")


def _serve_without_gc(log: Path) -> subprocess.Popen:
    """``sluice serve`` with Python's cycle collector off: a cleanup that waits for garbage collection
    (a stream's generator left suspended in a reference cycle) never comes, however long the test waits."""
    code = "import gc; gc.disable(); from sluice.cli.main import cli; cli()"
    out = log.open("ab")
    return subprocess.Popen([sys.executable, "-c", code, "serve", "--port", "0", "--log-level", "warning"], cwd=ROOT,
                            env={**os.environ, "SLUICE_API_KEY": KEY}, stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=default_sigint)


def _worker_idle(r: redis.Redis, worker_id: str) -> bool:
    beat = json.loads(r.get(keys.heartbeat(worker_id)) or "{}")
    return beat.get("held") == 0 and beat.get("running") == 0


def _left_behind(r: redis.Redis, ids: list[str]) -> list[str]:
    found = [k for k in r.scan_iter(match=f"{keys.PREFIX}:*{{req_*")]
    return found + [x for x in r.zrange(keys.interactive("tiny"), 0, -1) if x in ids]


def _request_ids(mon: Monitor) -> list[str]:
    """The online requests the API admitted (their ZADD into the admission set)."""
    return sorted({args[-1] for _, args in mon.commands() if args[:2] == ["ZADD", keys.interactive("tiny")]})


def _outcomes(mon: Monitor, rid: str) -> tuple[list[str], list[str]]:
    """What the request's results stream was given (status of each XADD), and what the worker settled
    its job as (the status of each write-back script it ran)."""
    given, settled = [], []
    for _, args in mon.commands():
        if args[:2] == ["XADD", keys.results(rid)]:
            given += re.findall(r'\\"status\\":\\"(\w+)\\"', " ".join(args))
        elif args[:1] == ["EVALSHA"] and args[2:4] == ["7", keys.meta(rid)]:  # scripts.record: 7 keys, meta first
            settled.append(args[11])  # ARGV[2]: the status
    return given, settled


def _deltas_after_delete(mon: Monitor, rid: str) -> list[str]:
    """Appends to the request's deltas stream after the API deleted it."""
    deleted, late = False, []
    for who, args in mon.commands():
        if args[:1] == ["DEL"] and keys.deltas(rid) in args:
            deleted = True
        elif deleted and args[:2] == ["XADD", keys.deltas(rid)]:
            late.append(who)
    return late


def test_dropped_streams_are_cancelled_and_leave_nothing(r: redis.Redis, tiny_model_dir: Path,
                                                         tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    assert MAX_TOKENS / PACE > 2 * GONE_BOUND  # a job the cancel misses is still running when the bound ends
    worker = worker_process(tiny_model_dir, "worker-s", "--max-num-seqs", "16", log=tmp_path / "worker.log",
                            paced=True)
    log = tmp_path / "serve.log"
    api = _serve_without_gc(log)
    try:
        url = wait_for_url(api, log, timeout=60)
        host, port = url.removeprefix("http://").split(":")
        wait_for(lambda: r.exists(keys.heartbeat("worker-s")), 120, "the worker")
        modes = [MODES[i % len(MODES)] for i in range(10)]
        rng.shuffle(modes)
        print("modes:", modes)
        gone: list[str] = []
        with monitored(r) as mon:
            threads = []
            for mode in modes:
                prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
                body: dict[str, Any] = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
                if mode == "killed_client":
                    target: Any = _killed_client
                    args: tuple[Any, ...] = (url, {**body, "prompt": prompt}, gone)
                elif rng.random() < 0.5:
                    target, args = _raw_client, (host, int(port), "/v1/completions", {**body, "prompt": prompt},
                                                 mode, gone)
                else:
                    target, args = _raw_client, (host, int(port), "/v1/chat/completions",
                                                 {**body, "messages": [{"role": "user", "content": prompt}]}, mode, gone)
                threads.append(threading.Thread(target=target, args=args, daemon=True))
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            assert sorted(gone) == sorted(modes), f"clients that did not get as far as leaving: {modes} vs {gone}"
            left_at = time.monotonic()

            # Aborted, not run out: paced, no job can finish within the bound.
            wait_for(lambda: _worker_idle(r, "worker-s"), GONE_BOUND, "the worker to abort every dropped stream")
            ids = _request_ids(mon)
            wait_for(lambda: not _left_behind(r, ids), GONE_BOUND, "the dropped requests' keys to go")
            print(f"all aborted and gone {time.monotonic() - left_at:.1f}s after the last client left")
            time.sleep(1.0)  # a last write-back or append in flight is seen by MONITOR too
        assert len(ids) == len(modes), ids
        for rid in ids:
            given, settled = _outcomes(mon, rid)
            assert given == ["cancelled"], f"{rid}: results stream got {given}"
            assert set(settled) <= {"cancelled"}, f"{rid}: the worker settled it {settled}"
            assert _deltas_after_delete(mon, rid) == [], f"{rid}: its deltas stream came back"
        assert _left_behind(r, ids) == []
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:
            worker.kill()
        assert stop(api) == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("server", ["embedded", "cluster"])
def test_an_append_after_the_request_is_gone_recreates_nothing(server: str, request: pytest.FixtureRequest) -> None:
    """The worker's append (interactive.append_deltas, one round trip for several requests, a node each on a
    cluster) reaches the requests still open and brings back none of those the API closed."""
    from sluice.jobs import interactive
    from sluice.jobs.lines import parse_line
    from sluice.jobs.scripts import Scripts
    from sluice.jobs.submit import submit_job

    r = request.getfixturevalue("r" if server == "embedded" else "cr")
    rng = random.Random(fresh_seed())
    s = Scripts(r)
    ids = [interactive.new_request_id() for _ in range(rng.randint(6, 12))]
    for rid in ids:
        job = parse_line(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(3)), "max_tokens": 4}), 1)
        assert interactive.admit(r, "tiny", rid, 100, 60.0)
        submit_job(r, job.model_copy(update={"stream": True}), "tiny", batch_id=rid, priority=0)
    texts = [(rid, 1, 0, rng.choice(WORDS)) for rid in ids]
    interactive.append_deltas(r, s, "worker-x", texts)
    assert all(r.xlen(keys.deltas(rid)) == 1 and r.ttl(keys.deltas(rid)) > 0 for rid in ids)
    closed = set(rng.sample(ids, len(ids) // 2))
    for rid in closed:
        interactive.close(r, "tiny", rid, cancel=True)
    interactive.append_deltas(r, s, "worker-x", texts)  # late: half of them are gone
    for rid in ids:
        assert r.xlen(keys.deltas(rid)) == (0 if rid in closed else 2), rid
        assert bool(r.exists(keys.meta(rid))) == (rid not in closed), rid
    for rid in set(ids) - closed:
        interactive.close(r, "tiny", rid, cancel=False)
    interactive.append_deltas(r, s, "worker-x", texts)
    assert _left_behind(r, ids) == []
