"""The API refuses an unauthenticated or oversized body before reading it, keeps
its metric labels bounded whatever the requests, and says plainly when its job server is a read-only
replica (503 in OpenAI's shape, and ``/healthz``). Bodies go straight through the ASGI interface (a
test client would buffer them first) so the test counts the bytes the app pulls. (Issue 21, items 6-8.)"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from helpers import fresh_seed
from jobs_helpers import wait_for
from sluice.api.app import create_app
from sluice.api.settings import Settings
from sluice.api.validation import max_line_bytes
from sluice.jobs.connection import connect, ensure_server, stop_server
from sluice.jobs.submit import submit

KEY = "sk-hardening"
BOUNDARY = "sluiceboundary"
CHUNK = 64 * 1024
STANDARD = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}


def settings(tmp_path: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = {"api_key": KEY, "files_dir": tmp_path / "files", "redis_url": "redis://127.0.0.1:1/0"}
    return Settings(**{**base, **kw})


def send_streamed(app: Any, method: str, path: str, headers: dict[str, str], body: Iterator[bytes],
                  ) -> tuple[int, dict[str, Any], int]:
    """One request through ``app``'s ASGI interface with ``body`` streamed chunk by chunk (chunked: no
    Content-Length unless ``headers`` give one). Returns the status, the JSON reply and the body bytes
    the app pulled."""
    pulled = [0]
    replies: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        chunk = next(body, None)
        pulled[0] += len(chunk or b"")
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(msg: dict[str, Any]) -> None:
        replies.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in replies if m["type"] == "http.response.start")
    reply = json.loads(b"".join(m.get("body", b"") for m in replies if m["type"] == "http.response.body"))
    return start["status"], reply, pulled[0]


def json_body(total: int) -> Iterator[bytes]:
    """``{"prompt": "xxx..."}`` of about ``total`` bytes, in chunks."""
    yield b'{"prompt": "'
    for _ in range(total // CHUNK):
        yield b"x" * CHUNK
    yield b'"}'


def multipart_body(total: int) -> Iterator[bytes]:
    yield (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
           f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.jsonl\"\r\n"
           "Content-Type: application/jsonl\r\n\r\n").encode()
    line = (json.dumps({"prompt": "short"}) + "\n").encode()
    for _ in range(total // (len(line) * 1000)):
        yield line * 1000
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


# ---- 6: authenticate before reading the body; cap every body ---------------------------------------------
@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_a_body_without_the_key_is_refused_before_it_is_read(tmp_path: Path, chunked: bool) -> None:
    """40 MB to /v1/jobs and to /v1/files (both under their caps' reach only with a key): 401, and the
    app pulled nothing of either body."""
    app = create_app(settings(tmp_path, max_upload_bytes=200 * 10**6))
    size = 40 << 20
    for key in (None, "wrong"):
        auth = {"authorization": f"Bearer {key}"} if key else {}
        length = {} if chunked else {"content-length": str(size)}
        status, reply, pulled = send_streamed(app, "POST", "/v1/jobs",
                                              {"content-type": "application/json", **auth, **length}, json_body(size))
        assert (status, reply["error"]["code"]) == (401, "invalid_api_key") and pulled == 0, (status, reply, pulled)
        status, reply, pulled = send_streamed(
            app, "POST", "/v1/files", {"content-type": f"multipart/form-data; boundary={BOUNDARY}", **auth, **length},
            multipart_body(size))
        assert (status, reply["error"]["code"]) == (401, "invalid_api_key") and pulled == 0, (status, reply, pulled)
    assert not list((tmp_path / "files").glob("*"))


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/batches"])
def test_every_json_body_is_capped(tmp_path: Path, path: str) -> None:
    """A JSON body is one batch line at most: past the longest line an upload would take, 413 as the
    body passes the cap (chunked) or at once (a declared length), in OpenAI's error shape."""
    s = settings(tmp_path, max_prompt_chars=1000)
    cap = max_line_bytes(s.max_prompt_chars)
    app = create_app(s)
    auth = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
    status, reply, pulled = send_streamed(app, "POST", path, auth, json_body(40 << 20))
    assert (status, reply["error"]["code"]) == (413, "request_too_large"), (status, reply)
    assert pulled <= cap + CHUNK, f"{pulled} bytes pulled with a cap of {cap}"
    status, reply, pulled = send_streamed(app, "POST", path, {**auth, "content-length": str(cap + 1)},
                                          json_body(40 << 20))
    assert (status, reply["error"]["code"], pulled) == (413, "request_too_large", 0), (status, reply, pulled)
    # Under the cap the body reaches the route (a 400 for the prompt's length, or the job server's 503).
    c = TestClient(app)
    r = c.post("/v1/jobs", json={"prompt": "x" * 1001}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long", r.text


# ---- 7: bounded metric labels ---------------------------------------------------------------------------
def _request_series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("sluice_api_requests_total{")]


def test_metric_labels_stay_bounded_whatever_the_requests(tmp_path: Path) -> None:
    """Made-up method tokens, paths and ids: the request counter's series stay a handful (a known
    method or ``other``, a route template or ``other``), and every request is still counted."""
    rng = random.Random(fresh_seed())
    c = TestClient(create_app(settings(tmp_path)))
    n = 400
    for i in range(n):
        method = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.randint(3, 12)))
        path = rng.choice(["/v1/files", f"/v1/files/file-{rng.getrandbits(64):x}", f"/nope/{i}", "/healthz"])
        c.request(method, path, headers={"Authorization": f"Bearer {KEY}"} if rng.random() < 0.5 else {})
    c.get(f"/v1/files/file-{rng.getrandbits(96):024x}", headers={"Authorization": f"Bearer {KEY}"})
    c.get("/v1/files")  # no key: refused at the gate, and counted
    series = _request_series(c.get("/metrics").text)
    labels = [dict(re.findall(r'(\w+)="([^"]*)"', s)) for s in series]
    assert {lab["method"] for lab in labels} <= STANDARD | {"other"}, series  # a draw may spell PUT or HEAD
    assert {lab["route"] for lab in labels} <= {"/v1/files", "/v1/files/{file_id}", "/healthz", "other"}, series
    assert {lab["status"] for lab in labels} >= {"401", "404", "405"}, series
    assert len(series) <= 16, series
    assert sum(float(s.rsplit(" ", 1)[1]) for s in series) >= n + 2


# ---- 8: a read-only job server (a replica after a failover) ---------------------------------------------
@pytest.fixture
def replica(tmp_path: Path) -> Iterator[tuple[redis.Redis, str]]:
    """Two embedded servers; the second made a replica of the first (as a failed-over-from primary is):
    yields the primary's client and the replica's URL."""
    homes = tmp_path / "primary", tmp_path / "replica"
    try:
        primary, second = ensure_server(homes[0]), ensure_server(homes[1])
        r1, r2 = connect(primary.url), connect(second.url)
        r2.config_set("masterauth", primary.password)
        r2.execute_command("REPLICAOF", "127.0.0.1", str(primary.port))
        wait_for(lambda: r2.info("replication").get("master_link_status") == "up", 30, "the replica's link")
        yield r1, second.url
        r1.close()
        r2.close()
    finally:
        for h in homes:
            stop_server(h, kill=True)


def test_a_read_only_job_server_answers_503_and_healthz_says_so(replica: tuple[redis.Redis, str],
                                                                tmp_path: Path) -> None:
    primary, url = replica
    c = TestClient(create_app(settings(tmp_path, api_key=None, redis_url=url)), raise_server_exceptions=False)
    line = json.dumps({"custom_id": "a", "prompt": "hello"})
    up = c.post("/v1/files", files={"file": ("f.jsonl", line.encode())}, data={"purpose": "batch"})
    assert up.status_code == 200, up.text
    for path, body in (("/v1/jobs", {"prompt": "hello"}),
                       ("/v1/batches", {"input_file_id": up.json()["id"], "endpoint": "/v1/completions",
                                        "completion_window": "24h"})):
        res = c.post(path, json=body)
        assert res.status_code == 503, (path, res.status_code, res.text)
        err = res.json()["error"]
        assert err["code"] == "job_server_read_only" and err["type"] == "server_error", err
        assert "read-only" in err["message"] and res.headers.get("retry-after"), res.headers
    health = c.get("/healthz")
    assert health.status_code == 503 and health.json()["status"] == "read_only", health.text
    assert "replica" in health.json()["job_server"], health.text
    assert primary.dbsize() == 0  # nothing of the refused requests reached the primary either
    # A batch the primary holds: the replica's API reads it, and a cancel (a write) is a 503 too.
    batch = submit([line], r=primary, model="default")
    wait_for(lambda: c.get(f"/v1/batches/{batch.id}").status_code == 200, 30, "the batch on the replica")
    res = c.post(f"/v1/batches/{batch.id}/cancel")
    assert res.status_code == 503 and res.json()["error"]["code"] == "job_server_read_only", res.text
    assert c.get(f"/v1/batches/{batch.id}").json()["status"] not in ("cancelling", "cancelled")
