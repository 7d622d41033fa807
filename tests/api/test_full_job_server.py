"""A full job server (issue 40, item 7): the embedded Valkey at a 1-byte ``maxmemory`` refuses every write,
and a real ``sluice serve`` answers every route that writes to it with the documented 507 in OpenAI's
error shape (``job_server_full``), the online endpoints streamed or not included, and keeps nothing."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from cli_api_helpers import WORDS, served_client
from helpers import fresh_seed
from sluice.jobs import keys

pytest_plugins = ["jobs_fixtures"]

KEY = "sk-sluice-test"


@pytest.fixture
def api(r: redis.Redis, tmp_path: Path) -> Iterator[httpx.Client]:
    """A real ``sluice serve`` on the test's embedded server (no worker: nothing here needs one)."""
    with served_client(tmp_path, KEY) as http:
        yield http


def _snapshot(r: redis.Redis) -> dict[str, bytes | None]:
    """Every key of the job plane and its serialized value (DUMP reads; it works on a full server)."""
    raw = redis.Redis(connection_pool=r.connection_pool)
    return {k: raw.dump(k) for k in r.scan_iter(match=f"{keys.PREFIX}:*") if not k.startswith(f"{keys.PREFIX}:lock:")}


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))


def _writes(rng: random.Random, file_id: str, batch_id: str, job_id: str) -> list[tuple[str, dict[str, Any]]]:
    """(path, JSON body) of each route that writes to the job server."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": _prompt(rng)}], "max_tokens": 8}
    text = {"model": "tiny", "prompt": _prompt(rng), "max_tokens": 8}
    return [
        ("/v1/batches", {"input_file_id": file_id, "endpoint": "/v1/completions", "completion_window": "24h"}),
        ("/v1/jobs", {"prompt": _prompt(rng), "max_tokens": 4}),
        (f"/v1/batches/{batch_id}/cancel", {}),
        (f"/v1/jobs/{job_id}/cancel", {}),
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/completions", text),
        ("/v1/completions", {**text, "stream": True, "stream_options": {"include_usage": True}}),
        ("/v1/embeddings", {"model": "tiny", "input": [_prompt(rng), _prompt(rng)]}),
    ]


def test_a_full_job_server_is_507_on_every_route_that_writes(r: redis.Redis, api: httpx.Client) -> None:
    rng = random.Random(fresh_seed())
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": _prompt(rng), "max_tokens": 4}}) for i in range(3)]
    upload = api.post("/v1/files", data={"purpose": "batch"},
                      files={"file": ("in.jsonl", ("\n".join(lines) + "\n").encode())})
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    # A batch and a job queued while there is room (no worker runs them): the cancels below have targets.
    batch = api.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions",
                                          "completion_window": "24h"})
    job = api.post("/v1/jobs", json={"prompt": _prompt(rng), "max_tokens": 4})
    assert batch.status_code == 200 and job.status_code == 200, (batch.text, job.text)
    before = _snapshot(r)

    r.config_set("maxmemory", 1)  # every write that needs memory is refused (OOM) from now
    try:
        # A connection each: a route that fails with a bare 500 has its connection dropped by the server.
        answers = [(path, body, httpx.post(api.base_url.join(path), json=body, headers=api.headers, timeout=60))
                   for path, body in _writes(rng, file_id, batch.json()["id"], job.json()["id"])]
        after = _snapshot(r)
    finally:
        r.config_set("maxmemory", 0)

    for path, body, reply in answers:
        what = f"{path} (stream={body.get('stream', False)}): {reply.status_code} {reply.text[:300]}"
        assert reply.status_code == 507, what
        assert reply.headers["content-type"] == "application/json", what
        err = reply.json()["error"]
        assert (err["code"], err["type"]) == ("job_server_full", "server_error"), what
        assert "job server is full" in err["message"], what
        assert reply.headers["retry-after"] == "60", what
    assert after == before  # nothing kept, nothing taken: the queued batch and job are as they were
    assert r.zcard(keys.interactive("tiny")) == 0
    # Room again: the same routes write (the cancel of the batch goes through now).
    assert api.post(f"/v1/batches/{batch.json()['id']}/cancel").json()["status"] in ("cancelling", "cancelled")


def test_a_full_job_server_keeps_a_live_workers_heartbeat(r: redis.Redis, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """While the server refuses writes (it is full), a working worker's heartbeat outlives its TTL (2 s), so
    no other worker may take its jobs; it says so once, not a traceback per beat; once memory frees, its
    results are written and each job has one outcome. (The heartbeat's SET was refused: the key expired.)"""
    from jobs_helpers import assert_exactly_once, held_by, prompt_lines, wait_for, worker_process
    from reliability_helpers import final
    from sluice.jobs.submit import submit

    rng = random.Random(fresh_seed())
    b = submit(prompt_lines(8, rng, max_tokens=300), r=r, model="tiny")
    log = tmp_path / "worker.log"
    p = worker_process(tiny_model_dir, "w1", "--exit-when-idle", "1", log=log, paced=True)
    beat = keys.heartbeat("w1")
    try:
        wait_for(lambda: held_by(r, b.id, "w1") > 0 or p.poll() is not None, 300, "the worker to hold jobs")
        assert p.poll() is None, log.read_text()[-3000:]
        r.config_set("maxmemory", 1)
        try:
            for _ in range(40):  # 8 s: four heartbeat TTLs
                assert r.pttl(beat) > 0, "the heartbeat lapsed while the server was full\n" + log.read_text()[-3000:]
                assert p.poll() is None, log.read_text()[-3000:]
                time.sleep(0.2)
        finally:
            r.config_set("maxmemory", 0)
        wait_for(lambda: final(r, b.id), 300, "the batch to finish")
        assert p.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        p.kill()
        p.wait()
    assert_exactly_once(r, b.id, 8)
    text = log.read_text()
    assert text.count("the job server is full: the heartbeat is kept alive") == 1, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
