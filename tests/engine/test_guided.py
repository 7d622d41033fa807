"""Structured output on a tiny random model: constrained and free requests share one continuous batch, the
free ones' tokens do not change, a grammar that cannot compile fails only its request, and a forced tool
call comes back as an OpenAI ``tool_calls`` entry whose arguments validate."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
from helpers import fresh_seed, make_tiny_model, random_prompts
from openai.types.chat import ChatCompletion
from sluice.engine.llm import LLM
from sluice.engine.outputs import Completion, Request
from sluice.engine.sampling_params import SamplingParams
from sluice.jobs.lines import parse_line
from sluice.jobs.openai_output import completion_body
from sluice.jobs.schemas import Job, Result
from sluice.worker.convert import completion_to_result, job_to_request

CHOICES = ["alpha", "beta", "gamma"]
PHONE = r"\d{3}-\d{4}"
SMALL = {"type": "object", "additionalProperties": False, "required": ["city", "days"], "properties": {
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 7}}}
# A Hermes-style chat template (as Qwen 2.5 and Hermes models ship): tools listed in the system turn,
# calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
HERMES = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n<tools>\n"
    "{%- for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant"
    "{%- for c in m.tool_calls %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoTokenizer

    path = make_tiny_model(tmp_path_factory.mktemp("hermes") / "m", seed=3)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = HERMES
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llm(hermes_model: Path) -> LLM:
    return LLM(str(hermes_model), dtype="float32", kv_cache_memory=32 << 20)


def test_mixed_batch_keeps_free_tokens_and_isolates_a_bad_grammar(llm: LLM) -> None:
    rng = random.Random(fresh_seed())
    prompts = random_prompts(rng, 12, 3, 30)
    free = [Request(f"free-{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=12))
            for i, p in enumerate(prompts[:6])]
    guided = [dict(guided_regex=PHONE), dict(guided_choice=CHOICES), dict(guided_json=SMALL),
              dict(guided_grammar='root ::= "x" [0-9] [0-9]?'), dict(guided_json=SMALL),
              dict(guided_choice=CHOICES)]
    constrained = [Request(f"g-{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=40, **g))
                   for i, (p, g) in enumerate(zip(prompts[6:], guided, strict=True))]
    bad = Request("bad", prompt_token_ids=prompts[0], params=SamplingParams(guided_regex="(unclosed"))

    mixed = {c.request_id: c for c in llm.generate(free + constrained + [bad])}
    assert llm.max_running_seen == len(free) + len(constrained)  # all in one continuous batch
    alone = {c.request_id: c for c in _run_alone(llm, free)}
    for r in free:
        assert mixed[r.request_id].token_ids == alone[r.request_id].token_ids, r.request_id

    assert mixed["bad"].finish_reason == "error" and "guided_regex does not compile" in mixed["bad"].error
    texts = {rid: c.text for rid, c in mixed.items()}
    assert all(mixed[f"g-{i}"].finish_reason == "stop" for i in range(6)), {k: mixed[k].finish_reason for k in mixed}
    assert re.fullmatch(PHONE, texts["g-0"]) and texts["g-1"] in CHOICES and texts["g-5"] in CHOICES
    jsonschema.validate(json.loads(texts["g-2"]), SMALL)
    jsonschema.validate(json.loads(texts["g-4"]), SMALL)
    assert re.fullmatch(r"x[0-9][0-9]?", texts["g-3"])


def test_a_grammar_that_does_not_compile_says_what_and_where(llm: LLM) -> None:
    """Issue 40, item 9: xgrammar's own reason and position, on one line (a Lark error's last line is
    its caret, which was all the message said)."""
    bad = {
        "lark": (dict(guided_grammar='start: "a" foo'), "the guided_grammar does not compile: Lark error at line 1, "
                 "column 12: unknown name 'foo' (in 'start: \"a\" foo')"),
        "lark2": (dict(guided_grammar='start: x\nx: "a" )'), "the guided_grammar does not compile: Lark error at "
                  "line 2, column 8: expected end of grammar item (in 'x: \"a\" )')"),
        "ebnf": (dict(guided_grammar='root ::= "a" b\nb ::= [z-a]'), "the guided_grammar does not compile: EBNF "
                 "parser error at line 2, column 8: Invalid character class: lower bound is larger than upper bound"),
        "regex": (dict(guided_regex="ab[c"), "the guided_regex does not compile: Regex parsing error at position 5: "
                  "Unclosed '['"),
        "json": (dict(guided_json={"type": "strin"}), 'the guided_json schema does not compile: Unsupported type "strin"'),
    }
    reqs = [Request(k, prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, **p)) for k, (p, _) in bad.items()]
    reqs.append(Request("fine", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=4, guided_choice=CHOICES)))
    got = {c.request_id: c for c in llm.generate(reqs)}
    for k, (_, message) in bad.items():
        assert (got[k].finish_reason, got[k].error) == ("error", message), k
    assert got["fine"].finish_reason == "stop" and got["fine"].text in CHOICES


def _run_alone(llm: LLM, reqs: list[Request]) -> list[Completion]:
    llm.max_running_seen = 0
    out = llm.generate(reqs)
    assert llm.max_running_seen == len(reqs)
    return out


def _tool_line(choice: object, extra_messages: list[dict] | None = None) -> str:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                               "parameters": SMALL}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                 "required": ["zone"], "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}] + (extra_messages or [])
    return json.dumps({"custom_id": "t", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "m", "messages": messages, "tools": tools, "tool_choice": choice,
                                "max_tokens": 80, "temperature": 0.8, "seed": 5}})


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_call_round_trip(llm: LLM, choice: object) -> None:
    history = [{"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_time", "arguments": "{\"zone\": \"UTC\"}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
               {"role": "user", "content": "And the weather?"}]
    job = parse_line(_tool_line(choice, history), 1)
    job.id = "t"
    req = job_to_request(job)
    prompt = llm.tokenizer.decode(llm._prompt_ids(req)[0])
    # The tools, the earlier call and the tool's answer all reach the template.
    assert '"name": "get_weather"' in prompt and "<tool_response>\n12:00" in prompt and '"zone": "UTC"' in prompt

    c = llm.generate([req])[0]
    body = ChatCompletion.model_validate(completion_body(job, _result(job, c, llm)))
    choice0 = body.choices[0]
    assert choice0.finish_reason == "tool_calls", c.text
    (call,) = choice0.message.tool_calls
    params = {"get_weather": SMALL, "get_time": json.loads(_tool_line("auto"))["body"]["tools"][1]["function"][
        "parameters"]}
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"


def _result(job: Job, c: Completion, llm: LLM) -> Result:
    return completion_to_result(job, c, llm.tokenizer)
