"""Structured output and tools as input lines carry them: vLLM's guided_* names and OpenAI's response_format
in simple lines and in ``body``; tool_choice forcing a call; bad values fail their line with a clear message;
the output line's shapes (tool_calls, logprobs, echo, finish_reason) parse with the openai package's types."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from sluice.engine.outputs import Completion as EngineCompletion
from sluice.engine.outputs import CompletionOutput, TokenLogprob, Usage
from sluice.engine.outputs import Timings as EngineTimings
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.openai_output import completion_body
from sluice.worker.convert import completion_to_result, job_to_request, parse_tool_calls

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _body(url: str = "/v1/chat/completions", **body: object) -> str:
    base = {"messages": [{"role": "user", "content": "hi"}]} if url.endswith("chat/completions") else {"prompt": "hi"}
    return json.dumps({"custom_id": "x", "method": "POST", "url": url, "body": {**base, **body}})


@pytest.mark.parametrize(("extra", "field", "value"), [
    ({"guided_json": SCHEMA}, "guided_json", json.dumps(SCHEMA, sort_keys=True)),
    ({"guided_regex": r"\d+"}, "guided_regex", r"\d+"),
    ({"guided_choice": ["a", "b"]}, "guided_choice", ("a", "b")),
    ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", 'root ::= "a"'),
    ({"response_format": {"type": "json_object"}}, "guided_json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     "guided_json", json.dumps(SCHEMA, sort_keys=True)),
])
def test_vllm_and_openai_names_in_body_and_simple_lines(extra: dict, field: str, value: object) -> None:
    for url in ("/v1/chat/completions", "/v1/completions"):
        assert getattr(parse_line(_body(url, **extra), 1).params, field) == value
    simple = parse_line(json.dumps({"prompt": "hi", **extra}), 1)
    assert getattr(simple.params, field) == value
    req = job_to_request(simple)  # and on to the engine's settings, field for field
    assert getattr(req.params, field) == (list(value) if isinstance(value, tuple) else value)


@pytest.mark.parametrize(("extra", "message"), [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "give at most one of"),
    ({"guided_json": "[1, 2]"}, "must be a JSON schema"),
    ({"guided_choice": []}, "guided_choice must not be empty"),
    ({"response_format": {"type": "yaml"}}, "response_format.type must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}}, "json_schema.schema"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not among the tools"),
    ({"guided_decoding_backend": "outlines"}, "only xgrammar"),
])
def test_bad_structured_fields_fail_their_line(extra: dict, message: str) -> None:
    with pytest.raises(LineError) as e:
        parse_line(_body(**extra), 7)
    assert str(e.value).startswith("line 7:") and message in str(e.value), str(e.value)


def test_tool_choice_forces_a_call_and_history_reaches_the_template() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
             {"type": "function", "function": {"name": "g"}}]
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "g", "arguments": "{\"q\": 1}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    job = parse_line(_body(messages=history, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}), 1)
    schema = json.loads(job.params.guided_json)
    assert schema["properties"]["name"] == {"const": "f"} and schema["properties"]["arguments"] == SCHEMA
    assert (job.params.guided_prefix, job.params.guided_suffix) == ("<tool_call>\n", "\n</tool_call>")
    assert job.messages[1]["tool_calls"][0]["function"]["arguments"] == {"q": 1}  # an object, as templates want
    assert job.messages[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    required = parse_line(_body(tools=tools, tool_choice="required"), 1)
    assert len(json.loads(required.params.guided_json)["anyOf"]) == 2
    auto = parse_line(_body(tools=tools), 1)
    assert auto.tool_choice == "auto" and auto.params.guided_json is None and job_to_request(auto).tools == tools


def test_parse_tool_calls_keeps_what_is_not_a_call() -> None:
    text, calls = parse_tool_calls('ok <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert text == "ok" and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", None)


def _engine_completion(text: str, reason: str, logprobs: list[TokenLogprob] | None = None) -> EngineCompletion:
    out = CompletionOutput(0, text, [1, 2], reason, logprobs)
    return EngineCompletion("x", [out], [5, 6], Usage(2, 2, 0), EngineTimings(1.0, 1.5, 2.0))


class _Tok:
    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_output_shapes_parse_with_openai_types() -> None:
    lps = [TokenLogprob(1, -0.5, [(1, -0.5), (3, float("-inf"))]), TokenLogprob(2, -0.1, [(2, -0.1)])]
    job = parse_line(_body("/v1/completions", prompt="Say", echo=True, max_tokens=2), 1)
    res = completion_to_result(job, _engine_completion(" hi", "length"), _Tok())
    body = Completion.model_validate(completion_body(job, res))
    assert body.choices[0].text == "Say hi" and body.choices[0].finish_reason == "length"

    job = parse_line(_body("/v1/completions", logprobs=2), 1)
    res = completion_to_result(job, _engine_completion("<1><2>", "stop", lps), _Tok())
    lp = Completion.model_validate(completion_body(job, res)).choices[0].logprobs
    assert lp.tokens == ["<1>", "<2>"] and lp.token_logprobs == [-0.5, -0.1] and lp.text_offset == [0, 3]
    assert lp.top_logprobs[0] == {"<1>": -0.5, "<3>": -9999.0}  # a masked-out token: finite, as OpenAI writes it

    job = parse_line(_body(logprobs=True, top_logprobs=2), 1)
    res = completion_to_result(job, _engine_completion("<1><2>", "stop", lps), _Tok())
    chat = ChatCompletion.model_validate(completion_body(job, res))
    assert [t.token for t in chat.choices[0].logprobs.content] == ["<1>", "<2>"]
    assert chat.choices[0].logprobs.content[0].top_logprobs[1].logprob == -9999.0

    job = parse_line(_body(tools=[{"type": "function", "function": {"name": "f"}}]), 1)
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    chat = ChatCompletion.model_validate(completion_body(job, completion_to_result(
        job, _engine_completion(call, "stop"), _Tok())))
    msg = chat.choices[0].message
    assert chat.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls[0].function.name == "f" and json.loads(msg.tool_calls[0].function.arguments) == {"a": 1}
    aborted = completion_body(job, completion_to_result(job, _engine_completion("par", "abort"), _Tok()))
    assert aborted["choices"][0]["finish_reason"] == "abort"  # not "stop"
