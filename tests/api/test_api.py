"""The HTTP API against a live ``sluice serve`` (a real uvicorn subprocess) and a worker on the tiny
model: the official ``openai`` package runs the whole batch flow; native jobs and the progressive
results download; auth, bad input, unknown ids; limits and a down job server in-process."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cli_api_helpers import (
    chat_lines,
    serving,
    simple_lines,
    sluice_home,
    tiny_worker,
    wait_final,
)
from fastapi.testclient import TestClient
from helpers import fresh_seed
from jobs_helpers import wait_for
from openai.types import Completion
from openai.types.chat import ChatCompletion
from sluice.api.app import create_app
from sluice.api.settings import Settings

KEY = "sk-sluice-test"


@dataclass
class Live:
    url: str
    home: Path

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def http(self, key: str | None = KEY) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60)


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("api") / "home"
    with sluice_home(home), tiny_worker(tiny_model_dir, queue="tiny"):
        with serving(home.parent / "serve.log", KEY) as url:
            yield Live(url, home)


def _upload(client: openai.OpenAI, lines: list[str], name: str = "input.jsonl") -> Any:
    return client.files.create(file=(name, ("\n".join(lines) + "\n").encode()), purpose="batch")


def test_openai_sdk_runs_the_whole_batch_flow(live: Live) -> None:
    rng = random.Random(fresh_seed())
    n, max_tokens = rng.randint(6, 14), rng.randint(2, 6)
    lines = chat_lines(rng, n, max_tokens=max_tokens)
    for i, text in enumerate(lines):  # the model named, "default", or left out: all run on the one worker
        obj = json.loads(text)
        if (choice := rng.choice(["tiny", "default", None])) is not None:
            obj["body"]["model"] = choice
        lines[i] = json.dumps(obj)
    client = live.client()

    f = _upload(client, lines, "prompts.jsonl")
    assert (f.purpose, f.filename, f.bytes) == ("batch", "prompts.jsonl", len("\n".join(lines)) + 1)
    assert client.files.retrieve(f.id).id == f.id
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"purpose": "test"})
    assert batch.input_file_id == f.id and batch.request_counts.total == n and batch.metadata == {"purpose": "test"}
    batch = wait_final(lambda: client.batches.retrieve(batch.id))

    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (n, 0)
    assert batch.error_file_id is None and batch.output_file_id
    assert batch.created_at <= batch.in_progress_at <= batch.completed_at
    content = client.files.content(batch.output_file_id).text
    assert client.files.retrieve(batch.output_file_id).bytes == len(content.encode())
    out = [json.loads(x) for x in content.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
    for x in out:
        assert x["error"] is None and x["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(x["response"]["body"])
        assert body.object == "chat.completion" and isinstance(body.choices[0].message.content, str)
        assert 1 <= body.usage.completion_tokens <= max_tokens
    assert batch.id in {b.id for b in client.batches.list(limit=1)}  # walks every page, one batch each


def test_openai_sdk_cancel_gives_an_error_file(live: Live) -> None:
    rng = random.Random(fresh_seed())
    client = live.client()
    n = 120
    f = _upload(client, [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                     "body": {"prompt": p, "max_tokens": 32, "ignore_eos": True}})
                         for i, p in enumerate(json.loads(x)["prompt"] for x in simple_lines(rng, n))])
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert client.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    batch = wait_final(lambda: client.batches.retrieve(batch.id))

    c = batch.request_counts
    assert batch.status == "cancelled" and batch.cancelled_at and c.total == n and c.completed + c.failed == n
    assert c.failed > 0, "every request finished before the cancel"
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == c.failed and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    if c.completed:
        for x in map(json.loads, client.files.content(batch.output_file_id).text.splitlines()):
            assert Completion.model_validate(x["response"]["body"]).object == "text_completion"
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: nothing changes


def test_native_job_and_progressive_results(live: Live) -> None:
    rng = random.Random(fresh_seed())
    http = live.http()
    job = http.post("/v1/jobs", json={"prompt": "The river", "max_tokens": 3}).json()
    assert job["id"].startswith("job_") and job["status"] in ("in_progress", "completed")

    def done() -> Any:
        got = http.get(f"/v1/jobs/{job['id']}")
        assert got.status_code == 200
        return got.json() if got.json()["status"] == "completed" else None

    finished = wait_for(done, 60, "the job")
    assert finished["response"]["body"]["object"] == "text_completion"
    assert finished["custom_id"] == "line-1" and finished["error"] is None

    n = rng.randint(15, 30)
    up = http.post("/v1/files", files={"file": ("s.jsonl", "\n".join(simple_lines(rng, n)).encode())},
                   data={"purpose": "batch"})
    assert up.status_code == 200, up.text
    batch = http.post("/v1/batches", json={"input_file_id": up.json()["id"], "endpoint": "/v1/completions",
                                           "completion_window": "24h"}).json()
    seen: list[str] = []
    cursor, pages = "0", 0
    while True:  # a progressive download: follow the cursor until the batch is final and read to its end
        page = http.get(f"/v1/batches/{batch['id']}/results", params={"after": cursor, "limit": 4})
        assert page.status_code == 200
        seen += [json.loads(x)["custom_id"] for x in page.text.splitlines()]
        cursor, pages = page.headers["Sluice-Cursor"], pages + 1
        if page.headers["Sluice-Complete"] == "true":
            break
    assert sorted(seen) == sorted(f"job-{i}" for i in range(n)) and pages > n // 4


def test_auth_health_metrics_and_schema(live: Live) -> None:
    for key in (None, "wrong"):
        r = live.http(key).get("/v1/batches")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        live.client("wrong").batches.list()
    plain = live.http(None)
    assert plain.get("/healthz").json() == {"status": "ok", "job_server": "ok", "workers": 1, "models": ["tiny"]}
    assert 'sluice_live_workers{queue="tiny"} 1.0' in plain.get("/metrics").text
    paths = plain.get("/openapi.json").json()["paths"]
    assert {"/v1/files", "/v1/batches", "/v1/jobs", "/v1/batches/{batch_id}/results"} <= set(paths)
    assert [m.id for m in live.client().models.list()] == ["tiny"]


def test_bad_input_names_the_line_and_unknown_ids_are_404(live: Live) -> None:
    rng = random.Random(fresh_seed())
    client = live.client()
    lines = chat_lines(rng, 8)
    bad = rng.randrange(len(lines))
    lines = [lines[bad][:-7]] + ["{}"] * bad  # torn JSON, then lines with no prompt: nothing can run
    with pytest.raises(openai.BadRequestError) as e:
        _upload(client, lines)
    err = e.value.response.json()["error"]
    assert err["line"] == 1 and err["message"].startswith("no line of the file can run: line 1: not valid JSON")
    assert [x["line"] for x in err["lines"]] == list(range(1, bad + 2)), err

    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
    f = _upload(client, chat_lines(rng, 2, model="gpt-4o-mini"))
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.code == "model_not_found" and "tiny" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert e.value.code == "endpoint_mismatch"

    for call in (lambda: client.files.retrieve("file-" + "0" * 24), lambda: client.files.content("file-nope"),
                 lambda: client.files.retrieve("file-output-batch_nope"), lambda: client.batches.retrieve("batch_nope"),
                 lambda: client.batches.cancel("batch_nope"),
                 lambda: client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    http = live.http()
    for path in ("/v1/jobs/job_nope", "/v1/batches/batch_nope/results", "/v1/jobs/batch_x"):
        assert http.get(path).status_code == 404
    assert http.get("/v1/batches", params={"after": "batch_nope"}).status_code == 404


def test_limits_and_a_down_job_server(tmp_path: Path) -> None:
    """In-process, with a job server that is not there: uploads are checked before it is needed."""
    settings = Settings(api_key=None, max_upload_bytes=3000, max_batch_lines=5, max_prompt_chars=40,
                        files_dir=tmp_path / "files", redis_url="redis://127.0.0.1:1/0")
    c = TestClient(create_app(settings))

    def upload(lines: list[str]) -> httpx.Response:
        return c.post("/v1/files", files={"file": ("f.jsonl", "\n".join(lines).encode())}, data={"purpose": "batch"})

    ok = [json.dumps({"custom_id": f"{i}", "prompt": "short"}) for i in range(6)]
    r = upload(ok)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_lines" and r.json()["error"]["line"] == 6
    r = upload([ok[0], json.dumps({"custom_id": "long", "prompt": "x" * 41})])
    assert r.status_code == 200  # as with sluice submit: the good line runs, the bad one goes to the error file
    r = upload([json.dumps({"custom_id": "long", "prompt": "x" * 41})])
    assert r.status_code == 400 and r.json()["error"]["code"] == "prompt_too_long" and r.json()["error"]["line"] == 1
    r = upload([json.dumps({"custom_id": f"{i}", "prompt": "y" * 30}) for i in range(70)])
    assert r.status_code == 413
    assert upload(ok[:5]).status_code == 200
    assert c.post("/v1/jobs", json={"prompt": "z" * 41}).status_code == 400

    r = c.get("/v1/batches")
    assert r.status_code == 503 and r.json()["error"]["code"] == "job_server_unavailable"
    assert c.get("/healthz").status_code == 503
    assert "sluice_job_server_up 0.0" in c.get("/metrics").text


def test_batch_objects_parse_with_the_openai_types(live: Live) -> None:
    """Structured output and logprobs in vLLM-style lines, bad lines beside good ones, the files' expiry and
    listing, the batch's usage: every object through the SDK's own pydantic types."""
    from openai.types import Batch, FileObject

    rng = random.Random(fresh_seed())
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    bodies = [{"messages": [{"role": "user", "content": "a number"}], "max_tokens": 30,
               "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}},
              {"messages": [{"role": "user", "content": "pick"}], "max_tokens": 10, "guided_choice": ["up", "down"],
               "logprobs": True, "top_logprobs": 2},
              {"messages": [{"role": "user", "content": "free"}], "max_tokens": 3, "seed": rng.randrange(99),
               "temperature": 1.0}]
    lines = [json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions", "body": b})
             for i, b in enumerate(bodies)]
    lines.insert(1, '{"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}')
    lines.append("not json")
    client = live.client()
    f = client.files.create(file=("mixed.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 7200})
    FileObject.model_validate(f.model_dump())
    assert f.expires_at == f.created_at + 7200
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="48h",
                                  output_expires_after={"anchor": "created_at", "seconds": 3600})
    assert batch.completion_window == "48h" and batch.request_counts.total == 3
    batch = wait_final(lambda: client.batches.retrieve(batch.id))
    Batch.model_validate(batch.model_dump())
    assert batch.status == "completed" and batch.request_counts.completed == 3

    out = {x["custom_id"]: x for x in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
    bodies_out = {k: ChatCompletion.model_validate(v["response"]["body"]) for k, v in out.items()}
    u = batch.usage
    assert u.input_tokens == sum(b.usage.prompt_tokens for b in bodies_out.values()) > 0
    assert u.output_tokens == sum(b.usage.completion_tokens for b in bodies_out.values()) > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.input_tokens_details.cached_tokens >= 0
    if bodies_out["s0"].choices[0].finish_reason == "stop":
        assert 0 <= json.loads(bodies_out["s0"].choices[0].message.content)["n"] <= 9
    pick = bodies_out["s1"].choices[0]
    assert pick.message.content in ("up", "down")
    assert "".join(t.token for t in pick.logprobs.content).startswith(pick.message.content)
    assert all(len(t.top_logprobs) == 2 for t in pick.logprobs.content)
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert sorted(e["error"]["line"] for e in errors) == [2, 5]  # the bad lines, by number
    for fid in (batch.output_file_id, batch.error_file_id):
        fo = client.files.retrieve(fid)
        FileObject.model_validate(fo.model_dump())
        assert fo.expires_at == fo.created_at + 3600

    g = client.files.create(file=("second.jsonl", (lines[0] + "\n").encode()), purpose="batch")
    assert g.expires_at == g.created_at + 30 * 24 * 3600
    desc = [x.id for x in client.files.list(order="desc", limit=100)]
    asc = [x.id for x in client.files.list(order="asc", limit=100)]
    assert asc == desc[::-1] and desc.index(g.id) < desc.index(f.id)
    page = client.files.list(limit=1, order="asc", after=asc[0])
    assert [x.id for x in page.data] == asc[1:2] and page.has_more == (len(asc) > 2)
    every = live.http().get("/v1/batches", params={"limit": 100}).json()
    batches = live.http().get("/v1/batches", params={"limit": 1}).json()
    assert batches["has_more"] == (len(every["data"]) > 1) and len(batches["data"]) == 1
    for b in every["data"]:
        Batch.model_validate(b)


def test_expired_files_are_deleted(tmp_path: Path) -> None:
    from sluice.api.filestore import FileStore

    store = FileStore(tmp_path)
    tmp = tmp_path / "upload"
    tmp.write_text('{"prompt": "x"}\n')
    old = store.add(tmp, "a.jsonl", "batch", {}, ttl=-1)  # already past its expires_at
    tmp.write_text('{"prompt": "y"}\n')
    new = store.add(tmp, "b.jsonl", "batch", {}, ttl=3600)
    assert store.delete_expired() == 1
    assert not old.path.exists() and store.get_upload(old.meta["id"]) is None
    assert store.get_upload(new.meta["id"]) is not None and new.path.exists()
