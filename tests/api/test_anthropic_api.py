"""Anthropic's Messages API and Message Batches on the queue, driven by the unmodified ``anthropic`` SDK
against a live ``sluice serve`` and a worker on the tiny model: ``messages.create`` streamed and not (the
same greedy text), ``messages.batches.create/retrieve/list/cancel/results/delete`` (every result parsed by
the SDK's types, each custom_id once, the texts the online answers), a bad request failing alone in its
batch, ``x-api-key`` auth, and errors in Anthropic's shape. The conversion itself is checked in-process."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from cli_api_helpers import WORDS, serving, sluice_home
from held_engine import HeldLLM
from helpers import fresh_seed
from jobs_helpers import ThreadWorker, wait_for
from pydantic import TypeAdapter
from sluice.jobs import keys
from sluice.jobs.anthropic import chat_body, read_requests
from sluice.jobs.connection import connect
from sluice.jobs.submit import submit

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK (the dev extra) drives these tests")
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse  # noqa: E402

KEY = "sk-sluice-test"
GREEDY = {"temperature": 0}  # anthropic 2.x has no temperature argument: it goes in extra_body


@dataclass
class Live:
    """``sluice serve`` (a subprocess) and a worker thread on the tiny model whose engine a test can hold."""

    url: str
    llm: HeldLLM

    def client(self, key: str = KEY, **kw: Any) -> Any:
        return anthropic.Anthropic(base_url=self.url, api_key=key, max_retries=0, timeout=120, **kw)

    def http(self, **headers: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"x-api-key": KEY, **headers}, timeout=120)


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("anthropic") / "home"
    log = home.parent / "serve.log"
    llm = HeldLLM(str(tiny_model_dir), dtype="float32", max_num_seqs=16, kv_cache_memory=8 << 20)
    with sluice_home(home):
        worker = ThreadWorker(llm, queue="tiny")
        try:
            with serving(log, KEY) as url:
                yield Live(url, llm)
        finally:
            worker.join()


def _words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))


def _params(rng: random.Random) -> dict[str, Any]:
    """Random Messages params: a string or text-block prompt, maybe a system prompt and stop sequences."""
    words = _words(rng)
    content: Any = words if rng.random() < 0.5 else [{"type": "text", "text": w + " "} for w in words.split()]
    p: dict[str, Any] = {"model": "tiny", "max_tokens": rng.randint(1, 8),
                         "messages": [{"role": "user", "content": content}]}
    if rng.random() < 0.5:
        p["system"] = _words(rng) if rng.random() < 0.5 else [{"type": "text", "text": _words(rng)}]
    if rng.random() < 0.3:
        p["stop_sequences"] = [rng.choice(WORDS)]
    return p


def _online(client: Any, p: dict[str, Any]) -> str:
    msg = client.messages.create(**p, extra_body=GREEDY)
    return "".join(b.text for b in msg.content if b.type == "text")


def _prompt_tokens(usage: Any) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


def _left_behind() -> list[str]:
    """Keys of online requests still in the job server (each request's keys go when it is answered)."""
    r = connect()
    return [k for k in r.scan_iter(match=f"{keys.PREFIX}:*{{req_*")] + list(r.zrange(keys.interactive("tiny"), 0, -1))


def _wait_ended(client: Any, batch_id: str) -> Any:
    return wait_for(lambda: (b := client.messages.batches.retrieve(batch_id)).processing_status == "ended" and b,
                    120, "the Message Batch to end", every=0.2)


# ---- online ----------------------------------------------------------------------------------------
def test_messages_create_streamed_and_not_give_the_same_greedy_text(live: Live) -> None:
    rng = random.Random(fresh_seed())
    client = live.client()
    for _ in range(4):
        p = _params(rng)
        msg = client.messages.create(**p, extra_body=GREEDY)
        assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny"
        assert [b.type for b in msg.content] == ["text"] and msg.stop_sequence is None
        assert msg.stop_reason in ("end_turn", "max_tokens")
        assert 1 <= msg.usage.output_tokens <= p["max_tokens"] and _prompt_tokens(msg.usage) > 0
        if msg.stop_reason == "max_tokens":
            assert msg.usage.output_tokens == p["max_tokens"]
        text = msg.content[0].text

        with client.messages.stream(**p, extra_body=GREEDY) as stream:
            assert stream.get_final_text() == text
            final = stream.get_final_message()
        assert (final.stop_reason, final.usage.output_tokens) == (msg.stop_reason, msg.usage.output_tokens)
        assert _prompt_tokens(final.usage) == _prompt_tokens(msg.usage)  # the second read some from the cache

        events = list(client.messages.create(**p, stream=True, extra_body=GREEDY))
        kinds = [e.type for e in events]
        assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
            "content_block_stop", "message_delta", "message_stop"], kinds
        assert set(kinds[2:-3]) <= {"content_block_delta"}
        assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
        assert events[-2].delta.stop_reason == msg.stop_reason
    assert _left_behind() == []


def test_raw_shapes_validate_with_the_sdks_types(live: Live) -> None:
    """The wire bodies as a client without the SDK reads them: each validates strictly as the SDK's type."""
    body = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "river gate"}],
            "temperature": 0, "top_p": 0.5, "top_k": 3, "metadata": {"user_id": "u1"}}
    with live.http() as http:
        got = http.post("/v1/messages", json=body)
        assert got.status_code == 200, got.text
        msg = Message.model_validate(got.json())
        assert msg.id.startswith("msg_") and msg.usage.cache_creation_input_tokens == 0
        with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as s:
            assert s.headers["content-type"].startswith("text/event-stream")
            lines = [x for x in s.iter_lines() if x]
    names = [x.removeprefix("event: ") for x in lines if x.startswith("event: ")]
    datas = [json.loads(x.removeprefix("data: ")) for x in lines if x.startswith("data: ")]
    assert len(names) == len(datas) and not [x for x in lines if not x.startswith(("event: ", "data: "))]
    events = TypeAdapter(list[RawMessageStreamEvent]).validate_python([d for d in datas if d["type"] != "ping"])
    assert [d["type"] for d in datas] == names
    assert [e.type for e in events][:2] == ["message_start", "content_block_start"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == msg.content[0].text
    assert _prompt_tokens(events[-2].usage) == _prompt_tokens(msg.usage) and events[-1].type == "message_stop"


# ---- batches -----------------------------------------------------------------------------------------
def test_message_batch_flow_with_the_sdk(live: Live) -> None:
    rng = random.Random(fresh_seed())
    client = live.client()
    n = rng.randint(5, 10)
    params = [_params(rng) for _ in range(n)]
    requests = [{"custom_id": f"req-{i}", "params": {**p, "temperature": 0}} for i, p in enumerate(params)]
    bad = rng.randrange(n + 1)
    requests.insert(bad, {"custom_id": "bad-one", "params": {"model": "tiny", "max_tokens": 4,
                                                               "messages": [{"role": "robot", "content": "x"}]}})
    # Bad where the engine's checks see it (a temperature past its range), and a second model in one batch.
    requests.append({"custom_id": "too-hot", "params": {**params[0], "temperature": 5000}})
    first = next(i for i, q in enumerate(requests) if q["custom_id"].startswith("req-"))  # names the batch's model
    requests.insert(rng.randint(first + 1, len(requests)), {"custom_id": "other-model",
                                                            "params": {**params[0], "model": "other"}})
    batch = client.messages.batches.create(requests=requests)
    assert isinstance(batch, MessageBatch) and batch.type == "message_batch"
    assert batch.processing_status in ("in_progress", "ended") and batch.created_at < batch.expires_at
    batch = _wait_ended(client, batch.id)
    c = batch.request_counts
    assert (c.processing, c.succeeded, c.errored, c.canceled, c.expired) == (0, n, 3, 0, 0), c
    assert batch.ended_at is not None and batch.results_url and batch.cancel_initiated_at is None

    results = list(client.messages.batches.results(batch.id))
    assert all(isinstance(x, MessageBatchIndividualResponse) for x in results)
    by_id = {x.custom_id: x.result for x in results}
    assert len(results) == len(by_id) == n + 3  # each custom_id exactly once
    for cid, fragment in [("bad-one", "role must be user or assistant"), ("too-hot", "temperature"),
                          ("other-model", "model_mismatch")]:
        assert by_id[cid].type == "errored", by_id[cid]
        assert by_id[cid].error.error.type == "invalid_request_error"
        assert fragment in by_id[cid].error.error.message, by_id[cid]
    online = [_online(client, p) for p in params]
    for i, want in enumerate(online):
        got = by_id[f"req-{i}"]
        assert got.type == "succeeded", got
        assert [b.type for b in got.message.content] == ["text"]
        assert got.message.content[0].text == want, (i, params[i])
        assert 1 <= got.message.usage.output_tokens <= params[i]["max_tokens"]

    # An OpenAI-style batch on the same server is not a Message Batch.
    other = submit([json.dumps({"custom_id": "x", "prompt": "weir", "max_tokens": 1})], r=connect(), model="tiny")
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.batches.retrieve(other.id)
    assert e.value.body == {"type": "error", "error": {"type": "not_found_error",
                                                       "message": f"No Message Batch found with id {other.id!r}."}}
    second = client.messages.batches.create(requests=requests[:1])
    listed = [b.id for b in client.messages.batches.list(limit=1)]  # walks every page, one batch each
    assert listed.index(second.id) < listed.index(batch.id) and len(listed) == len(set(listed))
    assert other.id not in listed
    newer = client.messages.batches.list(limit=1, before_id=batch.id)
    assert [b.id for b in newer.data] == [second.id]
    older = client.messages.batches.list(limit=1, after_id=second.id)
    assert [b.id for b in older.data] == [batch.id]
    _wait_ended(client, second.id)
    assert client.messages.batches.delete(second.id).id == second.id
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(second.id)


def test_cancel_gives_canceled_results(live: Live) -> None:
    rng = random.Random(fresh_seed())
    client = live.client()
    n = rng.randint(3, 8)
    requests = [{"custom_id": f"c{i}", "params": {**_params(rng), "max_tokens": 64}} for i in range(n)]
    with live.llm.held():  # no step runs: no request can finish before the cancel, on any machine
        batch = client.messages.batches.create(requests=requests)
        with live.http() as http:  # before the end: no results yet, said in Anthropic's shape
            early = http.get(f"/v1/messages/batches/{batch.id}/results")
        assert early.status_code == 400 and early.json()["error"]["type"] == "invalid_request_error"
        cancelled = client.messages.batches.cancel(batch.id)
        assert cancelled.processing_status in ("canceling", "ended") and cancelled.cancel_initiated_at
    batch = _wait_ended(client, batch.id)
    assert batch.request_counts.canceled == n and batch.request_counts.succeeded == 0
    results = list(client.messages.batches.results(batch.id))
    assert sorted(x.custom_id for x in results) == sorted(r["custom_id"] for r in requests)
    assert {x.result.type for x in results} == {"canceled"}
    assert client.messages.batches.cancel(batch.id).processing_status == "ended"  # again: nothing changes


# ---- auth and errors -------------------------------------------------------------------------------
def test_x_api_key_auth_and_anthropic_error_shapes(live: Live) -> None:
    p = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "mill wheel"}]}
    assert live.client().messages.create(**p).content  # the SDK sends x-api-key
    bearer = anthropic.Anthropic(base_url=live.url, auth_token=KEY, max_retries=0, timeout=120)
    assert bearer.messages.create(**p).content  # Authorization: Bearer, as before
    with pytest.raises(anthropic.AuthenticationError) as e:
        live.client("wrong").messages.create(**p)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with httpx.Client(base_url=live.url, timeout=60) as http:  # the OpenAI routes take x-api-key too
        assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        assert http.get("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401
        no_key = http.get("/v1/models")
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape

    client = live.client()
    for bad, fragment in [({**p, "messages": [{"role": "robot", "content": "x"}]}, "role must be user or assistant"),
                          ({**p, "extra_body": {"temperature": -1}}, "temperature"),
                          ({**p, "extra_body": {"top_k": -2}}, "top_k"),
                          ({**p, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "not supported"),
                          ({**p, "messages": [*p["messages"], {"role": "assistant", "content": "pre"}]}, "prefill"),
                          ({**p, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                           "only text blocks"),
                          ({**p, "model": "nope"}, "no worker serves model")]:
        with pytest.raises(anthropic.BadRequestError) as err:
            client.messages.create(**bad)
        assert set(err.value.body) == {"type", "error"} and err.value.body["type"] == "error"
        assert err.value.body["error"]["type"] == "invalid_request_error" and fragment in err.value.body["error"][
            "message"], (bad, err.value.body)
    with live.http() as http:
        raw = http.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert raw.status_code == 400 and raw.json()["type"] == "error", raw.text
        raw = http.post("/v1/messages", json={k: v for k, v in p.items() if k != "max_tokens"})
        assert raw.status_code == 400 and raw.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": "max_tokens: required"}}
        for body, fragment in [({"requests": []}, "non-empty"), ({"nope": 1}, "unknown field"),
                               ({"requests": [{"custom_id": "a", "params": {}}] * 2}, "appears twice"),
                               ({"requests": [{"params": {}}]}, "custom_id")]:
            got = http.post("/v1/messages/batches", json=body)
            assert got.status_code == 400 and got.json()["error"]["type"] == "invalid_request_error", got.text
            assert fragment in got.json()["error"]["message"]
    assert _left_behind() == []


def test_readme_example_runs(live: Live) -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "http-api.md").read_text()
    (example,) = [b for b in re.findall(r"^```python\n(.*?)^```", readme, re.M | re.S) if "import anthropic" in b]
    run = subprocess.run([sys.executable, "-c", example.replace("http://127.0.0.1:8000", live.url)],
                         env={**os.environ, "SLUICE_API_KEY": KEY}, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert set(re.findall(r"^(q\d+) ", run.stdout, re.M)) == {f"q{i}" for i in range(10)}, run.stdout


# ---- the conversion, in-process --------------------------------------------------------------------
def test_messages_params_map_onto_the_chat_body() -> None:
    body = chat_body({"model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "be "}, {"type": "text",
                      "text": "brief"}], "messages": [{"role": "user", "content": "a"}, {"role": "assistant",
                      "content": [{"type": "text", "text": "b"}]}, {"role": "user", "content": "c"}],
                      "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop_sequences": ["x"], "metadata": {}})
    assert body == {"model": "m", "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop": ["x"],
                    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
                                 {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}
    with pytest.raises(ValueError, match="unknown field 'frobnicate'"):
        chat_body({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "a"}], "frobnicate": 1})
    got = read_requests({"requests": [{"custom_id": "ok", "params": {"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "a"}]}}, {"custom_id": "streamed", "params": {"stream": True}}]}, 10)
    assert got.custom_ids == ["ok", "streamed"] and json.loads(got.lines[0])["url"] == "/v1/chat/completions"
    assert [(e.line, e.custom_id) for e in got.refused] == [(2, "streamed")] and got.lines[1] == "{}"
    with pytest.raises(ValueError, match="at most 1 per batch"):
        read_requests({"requests": [{"custom_id": "a", "params": {}}, {"custom_id": "b", "params": {}}]}, 1)
