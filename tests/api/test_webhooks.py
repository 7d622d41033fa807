"""Batch events to webhooks (issue 43, item 5): a live `sluice serve` POSTs batch.completed / batch.failed /
batch.expired / batch.cancelled to a local HTTP receiver in this test, signed as Standard Webhooks says (the
check below is written from its spec, not taken from the sender), retried while the receiver fails, each
attempt recorded (`sluice events`, GET /v1/batches/{id}/events); a URL the operator did not allow is refused."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from cli_api_helpers import chat_lines, run_sluice, sluice_home, start_sluice, stop, wait_for_url
from helpers import fresh_seed
from jobs_helpers import prompt_lines, wait_for, worker_process
from sluice.jobs import keys
from sluice.jobs.connection import connect
from sluice.jobs.housekeeping import housekeep
from sluice.jobs.store import served_queues
from sluice.jobs.submit import submit

KEY = "sk-hooks"
SECRET = "whsec_" + base64.b64encode(b"a test key of 24 bytes!!").decode()
TOLERANCE = 300  # seconds: Standard Webhooks' suggested timestamp tolerance


# ---- the receiver --------------------------------------------------------------------------------------
@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Receiver:
    url: str
    hits: list[Hit] = field(default_factory=list)
    fail_first: dict[str, int] = field(default_factory=dict)  # path -> attempts answered 500 before a 200
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on(self, path: str) -> list[Hit]:
        with self.lock:
            return [h for h in self.hits if h.path == path]


def serve_receiver() -> tuple[Receiver, ThreadingHTTPServer]:
    rec = Receiver("")

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with rec.lock:
                rec.hits.append(Hit(self.path, {k.lower(): v for k, v in self.headers.items()}, body))
                seen = sum(h.path == self.path for h in rec.hits)
                fail = seen <= rec.fail_first.get(self.path, 0)
            self.send_response(500 if fail else 204)
            self.end_headers()

        def log_message(self, *a: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return rec, server


def verify(h: Hit, secret: str = SECRET) -> dict[str, Any]:
    """Standard Webhooks verification, from the spec: the key is the base64 after ``whsec_``; the signed content
    is ``{webhook-id}.{webhook-timestamp}.{body}``; ``webhook-signature`` holds space-separated ``v1,<base64>``
    signatures, any of which may match (compared in constant time); the timestamp is recent."""
    msg_id, ts = h.headers["webhook-id"], h.headers["webhook-timestamp"]
    assert abs(time.time() - int(ts)) < TOLERANCE
    key = base64.b64decode(secret.split("_", 1)[1])
    expected = base64.b64encode(hmac.new(key, f"{msg_id}.{ts}.".encode() + h.body, hashlib.sha256).digest()).decode()
    sigs = [s.split(",", 1)[1] for s in h.headers["webhook-signature"].split(" ") if s.startswith("v1,")]
    assert any(hmac.compare_digest(expected, s) for s in sigs), "bad signature"
    event = json.loads(h.body)
    assert event["id"] == msg_id and h.headers["content-type"] == "application/json"
    return event


# ---- the server ----------------------------------------------------------------------------------------
@dataclass
class Live:
    url: str
    home: Path
    r: redis.Redis
    rec: Receiver

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("hooks") / "home"
    rec, receiver = serve_receiver()
    with sluice_home(home):
        env = {**os.environ, "SLUICE_API_KEY": KEY, "SLUICE_WEBHOOK_URL": f"{rec.url}/default",  # SLUICE_HOME set
               "SLUICE_WEBHOOK_SECRET": SECRET, "SLUICE_WEBHOOK_RETRY_AFTER": "0.2",
               "SLUICE_WEBHOOK_ALLOWED_URLS": f"{rec.url}/allowed/, https://hooks.example.com/x/"}
        log = home.parent / "serve.log"
        proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log, env=env)
        r = connect()
        try:
            live = Live(wait_for_url(proc, log, timeout=60), home, r, rec)
            with live.http() as http:
                assert http.get("/healthz").status_code == 200  # the app reaches the job server: deliveries start
            yield live
        finally:
            r.close()
            receiver.shutdown()
            assert stop(proc) == 0, log.read_text()


def events_of(live: Live, batch_id: str) -> list[dict[str, Any]]:
    with live.http() as http:
        got = http.get(f"/v1/batches/{batch_id}/events")
    assert got.status_code == 200, got.text
    return got.json()["data"]


def delivered(live: Live, batch_id: str) -> dict[str, Any] | None:
    evs = events_of(live, batch_id)
    return evs[0] if evs and evs[0]["delivery"]["state"] == "delivered" else None


def on_queue_nobody_serves(lines: list[str], r: redis.Redis, **kw: Any) -> Any:
    return submit(lines, r=r, model=f"idle-{random.randrange(10**9)}", **kw)


# ---- tests ---------------------------------------------------------------------------------------------
def test_completed_batch_is_posted_signed_and_retried_until_received(live: Live, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    live.rec.fail_first["/default"] = 2  # two 500s, then a 204
    p = worker_process(tiny_model_dir, "hooks-1", log=live.home.parent / "hooks-1.log")
    try:
        wait_for(lambda: "tiny" in served_queues(live.r), 120, "the worker to serve its queue")
        with live.http() as http:
            f = http.post("/v1/files", files={"file": ("in.jsonl", ("\n".join(chat_lines(rng, 5)) + "\n").encode())},
                          data={"purpose": "batch"}).json()
            b = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"}).json()
        ev = wait_for(lambda: delivered(live, b["id"]), 180, "the batch.completed webhook delivered")
    finally:
        p.kill()
        p.wait()
    hits = live.rec.on("/default")
    assert len(hits) == 3 and ev["delivery"]["attempts"] == 3, (hits, ev)
    bodies = [verify(h) for h in hits]
    assert len({h.headers["webhook-id"] for h in hits}) == 1  # the same event each time: receivers deduplicate
    event = bodies[-1]
    assert event == {"object": "event", "id": ev["id"], "type": "batch.completed", "created_at": event["created_at"],
                     "data": {"id": b["id"]}}
    assert abs(event["created_at"] - time.time()) < 600
    assert ev["delivery"]["url"] == f"{live.rec.url}/default" and ev["delivery"]["last_error"] is None

    out = run_sluice("events", b["id"], "--json")
    assert out.returncode == 0, out.stderr
    (listed,) = [json.loads(x) for x in out.stdout.splitlines()]
    assert listed["id"] == ev["id"] and listed["delivery"]["state"] == "delivered"
    assert ev["id"] in run_sluice("events").stdout
    assert not live.r.zscore(keys.webhooks_due(), b["id"])  # nothing left to deliver
    time.sleep(1.5)  # a few more rounds of the deliverer: no second delivery of a delivered event
    assert len(live.rec.on("/default")) == 3


def test_cancelled_batch_goes_to_its_own_allowed_url(live: Live) -> None:
    rng = random.Random(fresh_seed())
    url = f"{live.rec.url}/allowed/cancel-{rng.randrange(10**9)}"
    batch = on_queue_nobody_serves(prompt_lines(4, rng), live.r, metadata={"sluice_webhook_url": url})
    with live.http() as http:
        assert http.post(f"/v1/batches/{batch.id}/cancel").json()["status"] == "cancelled"
    path = url.removeprefix(live.rec.url)
    wait_for(lambda: live.rec.on(path), 60, "the batch.cancelled webhook")
    ev = wait_for(lambda: delivered(live, batch.id), 30, "its delivery recorded")
    event = verify(live.rec.on(path)[0])
    assert (event["type"], event["data"], ev["delivery"]["attempts"]) == ("batch.cancelled", {"id": batch.id}, 1)


def test_expired_and_failed_batches_are_posted(live: Live) -> None:
    rng = random.Random(fresh_seed())
    expiring = on_queue_nobody_serves(prompt_lines(3, rng), live.r, completion_window=3600)
    failing = on_queue_nobody_serves(["not json", "{}"], live.r)  # no valid line: the batch fails
    housekeep(live.r, now=time.time() + 7200)  # the window has passed
    want = {expiring.id: "batch.expired", failing.id: "batch.failed"}
    for bid in want:
        wait_for(lambda bid=bid: delivered(live, bid), 60, f"{want[bid]} delivered")
    got = {e["data"]["id"]: e["type"] for e in map(verify, live.rec.on("/default")) if e["data"]["id"] in want}
    assert got == want


def test_a_url_the_operator_did_not_allow_is_refused(live: Live) -> None:
    rng = random.Random(fresh_seed())
    with live.http() as http:
        f = http.post("/v1/files", files={"file": ("in.jsonl", ("\n".join(chat_lines(rng, 2)) + "\n").encode())},
                      data={"purpose": "batch"}).json()
        before = live.r.zcard(keys.all_batches())
        for url in (f"{live.rec.url}/elsewhere", "http://169.254.169.254/latest/meta-data/",
                    f"{live.rec.url}/allowed/../elsewhere", f"http://user:pw@{live.rec.url[7:]}/allowed/x",
                    "https://hooks.example.com.evil.test/x/", "file:///etc/passwd"):
            got = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                                 "metadata": {"sluice_webhook_url": url}})
            assert got.status_code == 400, (url, got.text)
            err = got.json()["error"]
            assert err["code"] == "webhook_url_not_allowed" and "SLUICE_WEBHOOK_ALLOWED_URLS" in err["message"]
        assert live.r.zcard(keys.all_batches()) == before  # nothing created
        ok = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                            "metadata": {"sluice_webhook_url": "https://hooks.example.com/x/y"}})
        assert ok.status_code == 200, ok.text
        http.post(f"/v1/batches/{ok.json()['id']}/cancel")
    # A batch written straight to the job server (no API check) is refused at delivery: nothing is sent.
    batch = on_queue_nobody_serves(prompt_lines(2, rng), live.r,
                                   metadata={"sluice_webhook_url": f"{live.rec.url}/elsewhere"})
    with live.http() as http:
        http.post(f"/v1/batches/{batch.id}/cancel")
    ev = wait_for(lambda: [e for e in events_of(live, batch.id) if e["delivery"]["state"] == "refused"], 60,
                  "the delivery refused")[0]
    assert ev["delivery"]["attempts"] == 0 and not live.rec.on("/elsewhere")
