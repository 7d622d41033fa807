"""Upload limits hold whatever the transfer: chunked bodies are counted as they stream, and one huge
line is refused before it is parsed whole (issue 11, item 8). In-process, no job server needed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sluice.api.app import create_app
from sluice.api.settings import Settings

BOUNDARY = "sluiceboundary"


def multipart(chunks: Iterator[bytes], sent: list[int]) -> Iterator[bytes]:
    """A multipart form (purpose=batch, file=...) whose file part streams from ``chunks``."""
    yield (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
           f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"f.jsonl\"\r\n"
           "Content-Type: application/jsonl\r\n\r\n").encode()
    for c in chunks:
        sent[0] += len(c)
        yield c
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


def client(tmp_path: Path, max_upload_bytes: int) -> TestClient:
    settings = Settings(api_key=None, max_upload_bytes=max_upload_bytes, max_prompt_chars=40,
                        files_dir=tmp_path / "files", redis_url="redis://127.0.0.1:1/0")
    return TestClient(create_app(settings))


def test_a_chunked_upload_is_refused_as_it_passes_the_limit(tmp_path: Path) -> None:
    """Straight through the ASGI interface (a test client would buffer the body first), counting the
    bytes the app pulls from a chunked body of ~200 MB against a 1 MB limit."""
    app = client(tmp_path, 1 << 20).app
    line = (json.dumps({"prompt": "short"}) + "\n").encode()
    sent = [0]
    body = multipart((line * 1000 for _ in range(10_000)), sent)
    replies: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        chunk = next(body, None)
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    async def send(msg: dict[str, Any]) -> None:
        replies.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/files", "raw_path": b"/v1/files", "query_string": b"", "root_path": "",
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", f"multipart/form-data; boundary={BOUNDARY}".encode()),
                         (b"transfer-encoding", b"chunked")]}
    asyncio.run(app(scope, receive, send))
    start = next(m for m in replies if m["type"] == "http.response.start")
    reply = json.loads(b"".join(m.get("body", b"") for m in replies if m["type"] == "http.response.body"))
    assert start["status"] == 413 and reply["error"]["code"] == "file_too_large"
    assert sent[0] < 2 << 20, f"{sent[0]} bytes were read with a 1 MB limit"
    assert not list((tmp_path / "files").glob("*.jsonl"))


def test_one_huge_line_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    c = client(tmp_path, 8 << 20)
    huge = json.dumps({"prompt": "x" * (3 << 20)}).encode()
    r = c.post("/v1/files", files={"file": ("f.jsonl", huge)}, data={"purpose": "batch"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "line_too_long" and r.json()["error"]["line"] == 1


def test_an_upload_to_a_full_disk_is_507_and_leaves_nothing(small_disk: Path) -> None:
    """The files directory on a real filesystem with no room left: OpenAI's error shape with 507, and no
    temporary file behind (it had been a bare 500 with the partial upload left on disk)."""
    filler = small_disk / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        f.write(b"\0" * (8 << 20))  # stops at ENOSPC
    settings = Settings(api_key=None, max_upload_bytes=64 << 20, files_dir=small_disk,
                        redis_url="redis://127.0.0.1:1/0")
    api = TestClient(create_app(settings))
    body = "".join(json.dumps({"custom_id": f"q{i}", "prompt": "hello " * 20}) + "\n" for i in range(2000))
    reply = api.post("/v1/files", files={"file": ("in.jsonl", body.encode())}, data={"purpose": "batch"})
    assert reply.status_code == 507, reply.text
    error = reply.json()["error"]
    assert error["code"] == "insufficient_storage" and "nothing was kept" in error["message"]
    assert [p.name for p in small_disk.iterdir()] == ["filler"]
    filler.unlink()  # with room again, the same upload is stored
    again = api.post("/v1/files", files={"file": ("in.jsonl", body.encode())}, data={"purpose": "batch"})
    assert again.status_code == 200, again.text
