"""``Idempotency-Key`` on ``POST /v1/batches`` and ``POST /v1/files`` (issue 43, item 6), against a live
`sluice serve` over real HTTP and its embedded Valkey: a retry with the same key and body gets the same object
(also when the duplicates race), another body is a 409, a failed request gives its key up, keys expire."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from cli_api_helpers import chat_lines, serving, sluice_home
from helpers import fresh_seed
from sluice.api.idempotency import IDEMPOTENCY_TTL
from sluice.jobs import keys
from sluice.jobs.connection import connect

KEY = "sk-idem"


@dataclass
class Live:
    url: str
    r: redis.Redis

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("idem") / "home"
    with sluice_home(home):
        with serving(home.parent / "serve.log", KEY) as url:
            r = connect()
            try:
                yield Live(url, r)
            finally:
                r.close()


def upload(http: httpx.Client, body: bytes, key: str | None = None, name: str = "in.jsonl") -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return http.post("/v1/files", files={"file": (name, body)}, data={"purpose": "batch"}, headers=headers)


def create(http: httpx.Client, file_id: str, key: str | None, **extra: Any) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key else {}
    return http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h", **extra}, headers=headers)


def lines(rng: random.Random, n: int = 3) -> bytes:
    return ("\n".join(chat_lines(rng, n)) + "\n").encode()


def race(live: Live, n: int, call: Any) -> list[httpx.Response]:
    """``call(http)`` from ``n`` threads released together."""
    gate, out = threading.Barrier(n), [None] * n

    def one(i: int, http: httpx.Client) -> None:
        gate.wait()
        out[i] = call(http)

    clients = [live.http() for _ in range(n)]
    threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for c in clients:
        c.close()
    assert all(x is not None for x in out)
    return out  # type: ignore[return-value]


def test_a_retried_batch_creation_returns_the_same_batch(live: Live) -> None:
    rng = random.Random(fresh_seed())
    key = f"create-{rng.randrange(10**9)}"
    with live.http() as http:
        f = upload(http, lines(rng)).json()
        before = live.r.zcard(keys.all_batches())
        first = create(http, f["id"], key, metadata={"run": "1"})
        again = create(http, f["id"], key, metadata={"run": "1"})
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert first.json()["id"] == again.json()["id"] and first.json()["object"] == "batch"
        assert again.headers.get("Idempotent-Replayed") == "true" and "Idempotent-Replayed" not in first.headers
        assert live.r.zcard(keys.all_batches()) == before + 1

        other = create(http, f["id"], key, metadata={"run": "2"})  # same key, another body
        assert other.status_code == 409, other.text
        err = other.json()["error"]
        assert err["code"] == "idempotency_key_reused" and "different request body" in err["message"]
        assert live.r.zcard(keys.all_batches()) == before + 1

        fresh = create(http, f["id"], key + "-b", metadata={"run": "2"})
        assert fresh.status_code == 200 and fresh.json()["id"] != first.json()["id"]
        assert 0 < live.r.ttl(keys.idempotency("batches", key)) <= IDEMPOTENCY_TTL


def test_concurrent_duplicates_make_one_batch(live: Live) -> None:
    rng = random.Random(fresh_seed())
    key = f"race-{rng.randrange(10**9)}"
    with live.http() as http:
        f = upload(http, lines(rng, 20)).json()
    before = live.r.zcard(keys.all_batches())
    got = race(live, 8, lambda http: create(http, f["id"], key))
    assert {g.status_code for g in got} == {200}, [g.text for g in got if g.status_code != 200]
    assert len({g.json()["id"] for g in got}) == 1
    assert sum(g.headers.get("Idempotent-Replayed") == "true" for g in got) == 7
    assert live.r.zcard(keys.all_batches()) == before + 1


def test_a_retried_upload_returns_the_same_file(live: Live) -> None:
    rng = random.Random(fresh_seed())
    key, body = f"file-{rng.randrange(10**9)}", lines(rng)
    with live.http() as http:
        count = len(http.get("/v1/files").json()["data"])
        first, again = upload(http, body, key), upload(http, body, key)
        assert first.status_code == again.status_code == 200, (first.text, again.text)
        assert first.json() == again.json() and again.headers.get("Idempotent-Replayed") == "true"
        assert len(http.get("/v1/files").json()["data"]) == count + 1

        for changed in (upload(http, body + lines(rng, 1), key), upload(http, body, key, name="other.jsonl")):
            assert changed.status_code == 409 and "different request body" in changed.text, changed.text
        assert len(http.get("/v1/files").json()["data"]) == count + 1

        key2 = key + "-race"
        got = race(live, 6, lambda h: upload(h, body, key2))
        assert {g.status_code for g in got} == {200} and len({g.json()["id"] for g in got}) == 1
        assert len(http.get("/v1/files").json()["data"]) == count + 2
        leftovers = [p for p in (Path(os.environ["SLUICE_HOME"]) / "files").glob(".upload-*")]
        assert not leftovers  # the replays' copies were dropped


def test_a_failed_request_gives_its_key_up(live: Live) -> None:
    rng = random.Random(fresh_seed())
    key = f"fail-{rng.randrange(10**9)}"
    with live.http() as http:
        missing = create(http, "file-nope", key)
        assert missing.status_code == 404, missing.text
        assert create(http, "file-nope", key).status_code == 404  # not remembered as an answer
        f = upload(http, lines(rng)).json()
        ok = create(http, f["id"], key)  # the key is free again: a corrected request runs
        assert ok.status_code == 200 and "Idempotent-Replayed" not in ok.headers, ok.text
        got = http.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions"},
                        headers={"Idempotency-Key": "x" * 256})
        assert got.status_code == 400 and got.json()["error"]["code"] == "invalid_idempotency_key", got.text
