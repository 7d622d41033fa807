"""Line parsing and output rendering (no Redis, no torch)."""

from __future__ import annotations

import json
import random
import sys

import pytest
from helpers import fresh_seed
from sluice.jobs.lines import LineError, normalize_messages, parse_line
from sluice.jobs.openai_output import result_to_output_line
from sluice.jobs.schemas import (
    Choice,
    ErrorInfo,
    Result,
    ResultUsage,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
)


def openai_line(url: str, body: dict, custom_id: str = "r1") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def test_jobs_never_import_torch() -> None:
    import subprocess

    code = ("import sluice.jobs.schemas, sluice.jobs.lines, sluice.jobs.openai_output, sluice.jobs.submit, sluice.jobs.store, sluice.jobs.housekeeping, "
            "sluice.jobs.consumer.session, sys; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_openai_chat_line() -> None:
    line = openai_line("/v1/chat/completions", {
        "model": "gpt-4o-mini", "max_completion_tokens": 7, "temperature": 0.5, "stop": "\n", "seed": 3,
        "logprobs": True, "top_logprobs": 2, "top_k": 5,
        "messages": [{"role": "developer", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]})
    job = parse_line(line, 4)
    assert job.kind == "chat" and job.custom_id == "r1" and job.line == 4 and job.model == "gpt-4o-mini"
    assert job.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    p = job.params
    assert (p.max_tokens, p.temperature, p.stop, p.seed, p.logprobs, p.top_k) == (7, 0.5, ("\n",), 3, 2, 5)


def test_openai_completions_line_and_defaults() -> None:
    defaults = SamplingParams(max_tokens=11, temperature=0.7)
    job = parse_line(openai_line("/v1/completions", {"model": "m", "prompt": ["Once"], "logprobs": 1}), 1, defaults)
    assert job.kind == "completion" and job.prompt == "Once"
    assert (job.params.max_tokens, job.params.temperature, job.params.logprobs) == (11, 0.7, 1)
    ids = parse_line(openai_line("/v1/completions", {"prompt": [1, 2, 3]}), 2)
    assert ids.prompt_token_ids == [1, 2, 3] and ids.prompt is None
    # OpenAI's list prompt: several prompts (texts or token ids) in one job, in order.
    many = parse_line(openai_line("/v1/completions", {"prompt": ["a", "b"], "n": 2}), 3)
    assert many.prompts == ["a", "b"] and many.prompt is None and many.params.n == 2
    assert parse_line(openai_line("/v1/completions", {"prompt": [[1, 2], [3]]}), 4).prompts == [[1, 2], [3]]
    # A line's own setting wins over the defaults; the rest of the defaults stay.
    job = parse_line(json.dumps({"prompt": "x", "temperature": 0}), 3, defaults)
    assert (job.params.max_tokens, job.params.temperature) == (11, 0.0)
    assert parse_line('{"prompt": "x"}', 4, defaults).params == defaults


def test_simple_lines() -> None:
    job = parse_line(json.dumps({"prompt": "hello", "max_tokens": 3, "priority": 2, "deadline": "2030-01-01T00:00:00"}), 9)
    assert job.custom_id == "line-9" and job.kind == "completion" and job.priority == 2
    assert job.deadline == 1893456000.0
    chat = parse_line(json.dumps({"custom_id": 17, "messages": [{"role": "user", "content": "hi"}], "n": 2}), 1)
    assert chat.custom_id == "17" and chat.kind == "chat" and chat.params.n == 2


def test_image_parts_stay_parts() -> None:
    """Text parts alone join into one string; with an image, the parts as processors' chat templates read them."""
    text = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert parse_line(json.dumps({"messages": [{"role": "user", "content": text}]}), 1).messages == [
        {"role": "user", "content": "ab"}]
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
             {"type": "text", "text": "what is it?"}]
    job = parse_line(json.dumps({"messages": [{"role": "user", "content": parts}]}), 1)
    assert job.messages == [{"role": "user", "content": [{"type": "image", "url": "data:image/png;base64,AAAA"},
                                                         {"type": "text", "text": "what is it?"}]}]
    assert normalize_messages(job.messages) == job.messages  # a dataset row's line is parsed again


@pytest.mark.parametrize("text, code, fragment", [
    ("{not json", "invalid_json", "not valid JSON"),
    ("[1, 2]", "invalid_line", "JSON object"),
    ('{"max_tokens": 3}', "invalid_request", "prompt or messages"),
    ('{"prompt": "x", "temprature": 1}', "invalid_request", "temprature"),
    ('{"prompt": "x", "max_tokens": 0}', "invalid_request", "max_tokens"),
    ('{"prompt": "x", "max_tokens": 2, "min_tokens": 3}', "invalid_request", "min_tokens"),
    ('{"prompt": "x", "max_tokens": 1048576, "n": 2}', "invalid_request", "n x max_tokens is 2,097,152"),
    ('{"prompt": "x", "top_p": 0}', "invalid_request", "top_p"),
    ('{"messages": [{"role": "wizard", "content": "x"}]}', "invalid_request", "role"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "invalid_request", "image_url.url"),
    ('{"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}', "invalid_request",
     "only text and image_url parts"),
    ('{"prompt": ["a", []]}', "invalid_request", "prompt[1] must be a string or a list of token ids"),
    ('{"prompt": [[1, 2], ["x"]]}', "invalid_request", "prompt[1] must be"),
    ('{"prompt": []}', "invalid_request", "prompt must be"),
    ('{"prompt": ["a", "b"], "max_tokens": 1048576}', "invalid_request", "prompts x n x max_tokens"),
    (openai_line("/v1/completions", {"prompt": ["x"] * 1025}), "invalid_request", "at most 1024"),
    (openai_line("/v1/images/generations", {"prompt": "x"}), "invalid_request", "url must be"),
    (openai_line("/v1/embeddings", {"input": "x", "max_tokens": 3}), "invalid_request", "unsupported field"),
    (openai_line("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
     "invalid_request", "stream"),
    (openai_line("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}),
     "invalid_request", "tools"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}), "invalid_request", "custom_id"),
])
def test_bad_lines_name_their_line(text: str, code: str, fragment: str) -> None:
    with pytest.raises(LineError) as e:
        parse_line(text, 42)
    assert e.value.line == 42 and e.value.code == code
    assert str(e.value).startswith("line 42: ") and fragment in str(e.value)
    assert isinstance(e.value, ValueError)


def test_random_simple_lines_round_trip() -> None:
    """Random valid settings come through parsing exactly, and bad values of each field are refused."""
    seed = fresh_seed()
    rng = random.Random(seed)
    for i in range(300):
        fields = {"max_tokens": rng.randint(1, 500), "temperature": round(rng.uniform(0, 2), 3),
                  "top_k": rng.randint(0, 50), "top_p": round(rng.uniform(0.01, 1), 3), "seed": rng.randint(0, 10**6),
                  "stop": [rng.choice("abc") * rng.randint(1, 3)], "n": rng.randint(1, 4)}
        fields = dict(rng.sample(sorted(fields.items()), rng.randint(0, len(fields))))
        job = parse_line(json.dumps({"custom_id": f"c{i}", "prompt": "p", **fields}), i + 1)
        got = job.params.model_dump()
        for k, v in fields.items():
            assert got[k] == (tuple(v) if isinstance(v, list) else v), f"seed={seed} field {k}"
    for k, bad in [("max_tokens", -1), ("temperature", -0.1), ("top_p", 1.5), ("n", 0), ("logprobs", 21)]:
        with pytest.raises(LineError):
            parse_line(json.dumps({"prompt": "p", k: bad}), 1)


def test_output_lines() -> None:
    chat = parse_line(openai_line("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}), 1)
    res = Result(job_id="b:0", custom_id="r1", text="hello", finish_reason="length",
                 usage=ResultUsage(prompt_tokens=5, completion_tokens=2, cached_tokens=1))
    line = result_to_output_line(chat, res)
    assert line["custom_id"] == "r1" and line["error"] is None and line["response"]["status_code"] == 200
    body = line["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "m"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"]["total_tokens"] == 7 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 1

    lp = [TokenLogprob(token_id=5, token="he", logprob=-0.5, top=[TopLogprob(token_id=5, token="he", logprob=-0.5)])]
    res = Result(job_id="b:1", custom_id="r2", kind="completion", text="he", finish_reason="stop",
                 choices=[Choice(index=0, text="he", finish_reason="stop", logprobs=lp),
                          Choice(index=1, text="x", finish_reason="length")])
    body = result_to_output_line(None, res)["response"]["body"]
    assert body["object"] == "text_completion" and [c["text"] for c in body["choices"]] == ["he", "x"]
    assert body["choices"][0]["logprobs"]["tokens"] == ["he"]

    cancelled = Result(job_id="b:2", custom_id="r3", status="cancelled",
                       error=ErrorInfo(code="batch_cancelled", message="the batch was cancelled"))
    line = result_to_output_line(None, cancelled)
    assert line["response"] is None and line["error"]["code"] == "batch_cancelled"
    failed = Result(job_id="b:3", custom_id="r4", status="failed", error=ErrorInfo(code="invalid_request", message="too long"))
    line = result_to_output_line(None, failed)
    assert line["response"]["status_code"] == 400 and line["error"]["message"] == "too long"
