"""OpenAI's Responses API on the queue (issue 42, item 2), driven by the unmodified ``openai`` SDK against a
live ``sluice serve`` and a worker on the tiny model: ``responses.create`` streamed and not (the SDK parses
every object and event; the raw bodies also validate as ``openai.types.responses.Response``), the same
greedy text as the chat completion of the same messages, text.format json_schema output that parses, a
forced function tool as a function_call item, a batch file of /v1/responses lines through the SDK's files
and batches, and bad requests (previous_response_id, an unsupported input item) a clear 400 online and a
failed line alone in a batch. The mapping of the request and the reasoning item are checked in-process."""

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
from cli_api_helpers import WORDS, serving, sluice_home, tiny_worker, wait_final
from helpers import fresh_seed
from jobs_helpers import wait_for
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from sluice.jobs import keys
from sluice.jobs.connection import connect
from sluice.jobs.responses import chat_body, response_body
from sluice.jobs.schemas import Choice, Result, ResultUsage

KEY = "sk-sluice-test"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
TOOL = {"type": "function", "name": "lookup", "description": "look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}},
                       "required": ["word"], "additionalProperties": False}}


@dataclass
class Live:
    url: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("responses") / "home"
    with sluice_home(home), tiny_worker(tiny_model_dir, queue="tiny"):
        with serving(home.parent / "serve.log", KEY) as url:
            yield Live(url)


def _words(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))


def _left_behind() -> list[str]:
    """Keys of online requests still in the job server, once a stream's end (which the server handles
    just after its last event reaches the client) has had time to clean up."""
    def keys_left() -> list[str]:
        r = connect()
        return [k for k in r.scan_iter(match=f"{keys.PREFIX}:*{{req_*")] + list(r.zrange(keys.interactive("tiny"), 0, -1))

    try:
        return wait_for(lambda: not keys_left(), 30, "the requests' keys to go") and []
    except AssertionError:
        return keys_left()


def _request(rng: random.Random) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Random Responses kwargs, and the chat messages they mean."""
    words, system = _words(rng), _words(rng)
    kw: dict[str, Any] = {"model": "tiny", "max_output_tokens": rng.randint(1, 8), "temperature": 0}
    form = rng.randrange(3)
    if form == 0:
        kw["input"] = words
    elif form == 1:
        kw["input"] = [{"role": "developer", "content": system},
                       {"role": "user", "content": [{"type": "input_text", "text": w + " "} for w in words.split()]}]
    else:
        kw.update(instructions=system, input=[{"type": "message", "role": "user", "content": words}])
    if form == 0:
        return kw, [{"role": "user", "content": words}]
    return kw, [{"role": "system", "content": system},
                {"role": "user", "content": words + (" " if form == 1 else "")}]


def test_responses_create_equals_the_chat_completion_streamed_and_not(live: Live) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    client = live.client()
    for _ in range(4):
        kw, messages = _request(rng)
        chat = client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                              max_tokens=kw["max_output_tokens"], temperature=0)
        want = chat.choices[0].message.content or ""
        got = client.responses.create(**kw)
        assert got.object == "response" and got.output_text == want, f"seed={seed}"
        assert got.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
        assert got.usage is not None and chat.usage is not None
        assert got.usage.output_tokens == chat.usage.completion_tokens
        assert got.usage.input_tokens == chat.usage.prompt_tokens
        assert [o.type for o in got.output] == ["message"] and got.id.startswith("resp_")

        events = list(client.responses.create(**kw, stream=True))
        kinds = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"], kinds
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.incomplete" if got.status == "incomplete" else "response.completed"], kinds
        assert set(kinds[4:-4]) <= {"response.output_text.delta"}
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want, f"seed={seed}"
        final = events[-1].response  # type: ignore[union-attr]
        assert final.output_text == want and final.usage is not None
        assert final.usage.output_tokens == got.usage.output_tokens
    assert _left_behind() == []


def test_raw_response_validates_as_the_sdks_type(live: Live) -> None:
    with live.http() as http:
        body = {"model": "tiny", "input": "river gate", "max_output_tokens": 3, "temperature": 0, "store": True,
                "instructions": "be brief", "metadata": {"k": "v"}}
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        resp = Response.model_validate(r.json())
        assert resp.instructions == "be brief" and resp.max_output_tokens == 3 and resp.output_text
        gone = http.get(f"/v1/responses/{resp.id}")
        assert gone.status_code == 404 and "not stored" in gone.json()["error"]["message"]
        # Streamed, every event validates strictly as the SDK's event union (the SDK itself is lenient).
        for extra in ({}, {"tools": [TOOL], "tool_choice": "required", "max_output_tokens": 64}):
            with http.stream("POST", "/v1/responses", json={**body, **extra, "stream": True}) as s:
                lines = [x for x in s.iter_lines() if x.startswith("data: ")]
            events = [EVENTS.validate_python(json.loads(x.removeprefix("data: "))) for x in lines]
            assert events[-1].type in ("response.completed", "response.incomplete")
            assert events[-1].response.output  # type: ignore[union-attr]


def test_text_format_json_schema_output_parses(live: Live) -> None:
    client = live.client()
    for stream in (False, True):
        kw = {"model": "tiny", "input": "is the river wide?", "max_output_tokens": 64, "temperature": 0,
              "text": {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}}
        if stream:
            events = list(client.responses.create(**kw, stream=True))
            resp = events[-1].response  # type: ignore[union-attr]
        else:
            resp = client.responses.create(**kw)
        assert resp.status == "completed", resp
        assert isinstance(json.loads(resp.output_text)["ok"], bool)
        assert resp.text is not None and resp.text.format.type == "json_schema"


def test_a_forced_function_tool_gives_a_function_call_item(live: Live) -> None:
    client = live.client()
    kw = {"model": "tiny", "input": "look up river", "max_output_tokens": 64, "temperature": 0, "tools": [TOOL],
          "tool_choice": "required"}
    resp = client.responses.create(**kw)  # type: ignore[arg-type]
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "lookup" and calls[0].call_id, resp
    assert isinstance(json.loads(calls[0].arguments)["word"], str)
    assert resp.tools[0].type == "function" and resp.tools[0].name == "lookup"

    events = list(client.responses.create(**kw, stream=True))  # type: ignore[arg-type]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments
    final = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in final.output if o.type == "function_call"] == ["function_call"]

    # The call's output sent back (function_call + function_call_output items) runs as a tool turn.
    again = client.responses.create(model="tiny", max_output_tokens=4, temperature=0, tools=[TOOL],  # type: ignore[list-item]
                                    input=[{"role": "user", "content": "look up river"},
                                           {"type": "function_call", "call_id": calls[0].call_id, "name": "lookup",
                                            "arguments": calls[0].arguments},
                                           {"type": "function_call_output", "call_id": calls[0].call_id,
                                            "output": "a flowing body of water"}])
    assert again.status in ("completed", "incomplete")
    assert _left_behind() == []


def test_bad_requests_are_a_clear_400(live: Live) -> None:
    client = live.client()
    cases = [({"previous_response_id": "resp_x"}, "previous_response_id: responses are not stored here"),
             ({"input": [{"type": "file_search_call", "id": "x"}]}, "input[0]: input items of type 'file_search_call'"),
             ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
              "only input_text parts"),
             ({"tools": [{"type": "web_search"}]}, "tools[0]: only function tools"),
             ({"text": {"format": {"type": "xml"}}}, "text.format.type must be")]
    for extra, fragment in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**{"model": "tiny", "input": "hi", "max_output_tokens": 2, **extra})
        assert fragment in str(e.value), str(e.value)
    assert client.responses.create(model="tiny", input="hi", max_output_tokens=2, store=True).output_text is not None
    assert _left_behind() == []


def test_batch_file_of_responses_lines_through_the_sdk(live: Live) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    client = live.client()
    reqs = [_request(rng)[0] for _ in range(4)]
    online = [client.responses.create(**kw).output_text for kw in reqs]
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses", "body": kw} for i, kw in enumerate(reqs)]
    lines.append({"custom_id": "prev", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "tiny", "input": "hi", "previous_response_id": "resp_1"}})
    lines.append({"custom_id": "item", "method": "POST", "url": "/v1/responses",
                  "body": {"model": "tiny", "input": [{"type": "computer_call", "id": "c"}]}})
    f = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    assert batch.endpoint == "/v1/responses"
    batch = wait_final(lambda: client.batches.retrieve(batch.id))
    assert batch.status == "completed" and batch.output_file_id and batch.error_file_id, batch
    assert batch.request_counts is not None and batch.request_counts.completed == len(reqs)
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    got = {x["custom_id"]: Response.model_validate(x["response"]["body"]) for x in out}
    assert {k: v.output_text for k, v in got.items()} == {f"r{i}": t for i, t in enumerate(online)}, f"seed={seed}"
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    messages = sorted(e["error"]["message"] for e in errors)
    assert len(messages) == 2 and "previous_response_id" in messages[0] and "'computer_call'" in messages[1], messages


# ---- in-process: the mapping, and what the tiny model cannot show ----------------------------------
def test_request_mapping_onto_the_chat_body() -> None:
    body = chat_body({"model": "m", "instructions": "sys", "input": [
        {"role": "developer", "content": "dev"}, {"role": "assistant", "content": [{"type": "output_text", "text": "a"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "q"}]}, {"type": "reasoning", "summary": []}],
        "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "reasoning": {"effort": "low"}, "store": True,
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "lookup"}, "text": {"format": {"type": "text"}}})
    assert body["messages"] == [{"role": "system", "content": "sys"}, {"role": "system", "content": "dev"},
                                {"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["reasoning_effort"]) == (7, 0.5, 0.9, "low")
    assert body["tools"][0]["function"]["name"] == "lookup"
    assert body["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}
    assert "response_format" not in body


def test_reasoning_and_tool_calls_render_as_output_items() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "x"}'}}
    result = Result(job_id="b:0", custom_id="c", api="responses", text="", finish_reason="tool_calls",
                    choices=[Choice(index=0, text="", finish_reason="tool_calls", reasoning="hmm", tool_calls=[call])],
                    usage=ResultUsage(prompt_tokens=5, completion_tokens=4, reasoning_tokens=2))
    resp = Response.model_validate(response_body(result, "m"))
    assert [o.type for o in resp.output] == ["reasoning", "function_call"]
    assert resp.output[0].content is not None and resp.output[0].content[0].text == "hmm"  # type: ignore[union-attr]
    assert resp.usage is not None and resp.usage.output_tokens_details.reasoning_tokens == 2
