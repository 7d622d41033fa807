"""Reasoning models and chat-template options (issue 23, items 1-3) on a tiny random Qwen3 whose tokenizer
has think tokens and whose chat template honours enable_thinking (tests/support/reasoning_model.py): the toggle
changes the prompt, the thinking goes to reasoning_content and is counted, a trace cut inside the thinking
has no answer, a JSON schema constrains only the answer, and the thinking budget forces the end of
thinking. Token ids are checked against transformers' greedy generate on the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from click.testing import CliRunner
from helpers import assert_greedy_matches, hf_greedy
from openai.types.chat import ChatCompletion
from reasoning_model import make_reasoning_model
from sluice.cli.main import cli
from sluice.engine.guided import apply_guided_masks
from sluice.engine.llm import LLM
from sluice.engine.outputs import CompletionOutput, Request
from sluice.engine.reasoning import Phase, ThinkState, find_parser, split_output
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.openai_output import completion_body
from sluice.jobs.schemas import Job
from sluice.jobs.schemas import SamplingParams as JobParams
from sluice.worker.convert import completion_to_result, job_to_request

ASK = [{"role": "user", "content": "Is the sky blue?"}]
OFF = {"enable_thinking": False}
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_reasoning_model(tmp_path_factory.mktemp("reasoning") / "m", seed=5)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _chat(rid: str, kwargs: dict | None = None, **params: object) -> Request:
    return Request(rid, messages=ASK, params=SamplingParams(**params), chat_template_kwargs=kwargs)


def _body(job_line: str, llm: LLM) -> tuple[Job, dict]:
    """A line through the engine, the worker's conversion and the OpenAI output shape (validated)."""
    job = parse_line(job_line, 1)
    [c] = llm.generate([job_to_request(job)])
    body = completion_body(job, completion_to_result(job, c, llm.tokenizer))
    ChatCompletion.model_validate(body)
    return job, body


# ---- 1. chat-template options ----------------------------------------------------------------------
def test_lines_carry_template_options_and_the_batch_default_merges_key_by_key() -> None:
    body = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low",
                     "max_reasoning_tokens": 7}}
    job = parse_line(json.dumps(body), 1)
    assert json.loads(job.params.chat_template_kwargs) == {"enable_thinking": False, "reasoning_effort": "low"}
    assert job.params.max_reasoning_tokens == 7
    req = job_to_request(Job.model_validate_json(job.model_dump_json()))  # as the queue carries it
    assert req.chat_template_kwargs == {"enable_thinking": False, "reasoning_effort": "low"}
    assert req.params.max_reasoning_tokens == 7

    batch = JobParams(chat_template_kwargs='{"enable_thinking": false, "x": 1}')
    simple = parse_line(json.dumps({"messages": ASK, "chat_template_kwargs": {"x": 2}}), 1, batch)
    assert json.loads(simple.params.chat_template_kwargs) == {"enable_thinking": False, "x": 2}
    plain = parse_line(json.dumps({"messages": ASK}), 2, batch)
    assert json.loads(plain.params.chat_template_kwargs) == {"enable_thinking": False, "x": 1}


@pytest.mark.parametrize(("line", "message"), [
    ({"messages": ASK, "chat_template_kwargs": [1]}, "must be a JSON object"),
    ({"messages": ASK, "chat_template_kwargs": "{not json"}, "must be a JSON object"),
    ({"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}, "is for chat messages"),
    ({"messages": ASK, "reasoning_effort": 3}, "reasoning_effort must be a string"),
    ({"messages": ASK, "max_reasoning_tokens": -1}, "max_reasoning_tokens"),
])
def test_bad_reasoning_fields_fail_their_line(line: dict, message: str) -> None:
    with pytest.raises(LineError) as e:
        parse_line(json.dumps(line), 4)
    assert str(e.value).startswith("line 4:") and message in str(e.value), str(e.value)


def test_the_toggle_and_reasoning_effort_change_the_prompt(llm: LLM) -> None:
    on, off, effort, clash = llm.generate([_chat("on", max_tokens=1), _chat("off", OFF, max_tokens=1),
                                           _chat("effort", {"reasoning_effort": "high"}, max_tokens=1),
                                           _chat("clash", {"tokenize": False}, max_tokens=1)])
    text = llm.tokenizer.decode
    assert text(on.prompt_token_ids).endswith("<think>\n")
    assert text(off.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    assert "Reasoning: high" in text(effort.prompt_token_ids) and "Reasoning" not in text(on.prompt_token_ids)
    assert clash.finish_reason == "error" and "'tokenize'" in (clash.error or "")  # that request alone


# ---- 2. the split -------------------------------------------------------------------------------------
def test_budget_forces_the_end_of_thinking_and_the_split_matches_transformers(llm: LLM, hf: object) -> None:
    budget, max_tokens = 4, 10
    [c] = llm.generate([_chat("r", max_tokens=max_tokens, max_reasoning_tokens=budget, ignore_eos=True)])
    end = llm.reasoning.end_id
    prompt, out = c.prompt_token_ids, c.token_ids
    # Free thinking for ``budget`` tokens, then the forced end, then the answer: transformers' greedy each way.
    assert_greedy_matches(hf, prompt, out[:budget], hf_greedy(hf, prompt, budget))
    assert out[budget] == end and end not in out[:budget]
    head = out[:budget + 1]
    assert_greedy_matches(hf, prompt + head, out[budget + 1:], hf_greedy(hf, prompt + head, max_tokens - budget - 1))
    o = c.outputs[0]
    assert o.reasoning_tokens == budget + 1
    assert o.reasoning == llm.tokenizer.decode(out[:budget], skip_special_tokens=True).strip("\n")
    assert o.text == llm.tokenizer.decode(out[budget + 1:], skip_special_tokens=True).lstrip("\n")


def test_a_trace_cut_inside_thinking_has_no_answer(llm: LLM) -> None:
    line = json.dumps({"custom_id": "cut", "messages": ASK, "max_tokens": 5, "ignore_eos": True})
    _, body = _body(line, llm)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert choice["message"]["reasoning_content"] and choice["message"]["reasoning"] == choice["message"]["reasoning_content"]
    assert body["usage"]["completion_tokens"] == 5
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


def test_thinking_off_is_all_answer(llm: LLM) -> None:
    line = json.dumps({"custom_id": "off", "messages": ASK, "max_tokens": 5, "chat_template_kwargs": OFF})
    _, body = _body(line, llm)
    msg = body["choices"][0]["message"]
    assert "reasoning_content" not in msg and isinstance(msg["content"], str)
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


# ---- 3. structured output after thinking --------------------------------------------------------------
def test_a_json_schema_constrains_only_the_answer(llm: LLM, hf: object) -> None:
    budget = 3
    schema = {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}
    line = json.dumps({"custom_id": "j", "messages": ASK, "max_tokens": 30, "max_reasoning_tokens": budget,
                       "response_format": schema, "ignore_eos": True})
    job, body = _body(line, llm)
    [c] = llm.generate([job_to_request(job)])
    # The thinking is what the model says unconstrained; the answer after the end of thinking is the schema's.
    assert_greedy_matches(hf, c.prompt_token_ids, c.token_ids[:budget], hf_greedy(hf, c.prompt_token_ids, budget))
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), VERDICT)
    assert choice["message"]["reasoning_content"] is not None
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget + 1


def test_a_free_thinking_is_not_held_by_the_grammar(llm: LLM) -> None:
    """Cut inside the thinking, a constrained reply's tokens are the free reply's."""
    free, guided = llm.generate([_chat("free", max_tokens=6, ignore_eos=True),
                                 _chat("guided", max_tokens=6, ignore_eos=True, guided_json=VERDICT)])
    assert guided.token_ids == free.token_ids and guided.outputs[0].text == ""


def test_with_thinking_off_the_grammar_applies_from_the_first_token(llm: LLM) -> None:
    [c] = llm.generate([_chat("off", OFF, max_tokens=30, guided_json=VERDICT)])
    assert c.outputs[0].reasoning is None and c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), VERDICT)


def test_a_model_that_opens_its_own_thinking(llm: LLM) -> None:
    """Qwen3's way (the prompt does not open the block): the first token may be <think>, even under a
    grammar; the split then starts after it."""
    p = llm.reasoning
    seq = Sequence(0, "q", 0, [5, 6], 2, SamplingParams(guided_json=VERDICT))
    llm.guided.attach([seq], llm.guided.compile(seq.params))
    seq.think = ThinkState(p.start_id, p.end_id, None, Phase.BEFORE)
    with torch.inference_mode():  # as the model runner calls it
        logits = torch.zeros(1, llm.vocab_size)
        apply_guided_masks(logits, [seq])
    assert logits[0, p.start_id] == 0 and logits[0, ord("x")] == float("-inf")  # <think> allowed, free text not
    assert seq.think.advance(p.start_id) and seq.think.thinking

    ids = [p.start_id, *llm.tokenizer.encode("\nhmm\n"), p.end_id, *llm.tokenizer.encode("\n\nyes")]
    out = CompletionOutput(0, llm.tokenizer.decode(ids), ids, "stop")
    split_output(out, p, Request("q", messages=ASK), [5, 6], llm.tokenizer)
    assert (out.reasoning, out.text, out.reasoning_tokens) == ("hmm", "yes", ids.index(p.end_id) + 1)


def test_parser_names(llm: LLM) -> None:
    assert find_parser(llm.tokenizer).name in ("qwen3", "deepseek_r1")
    assert find_parser(llm.tokenizer, "none") is None
    with pytest.raises(ValueError, match="not single tokens"):
        find_parser(llm.tokenizer, "seed_oss")
    with pytest.raises(ValueError, match="reasoning_parser must be"):
        find_parser(llm.tokenizer, "nope")


# ---- through `sluice generate` -------------------------------------------------------------------------
def test_generate_with_a_batch_wide_toggle_and_a_line_that_overrides_it(model_dir: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": "plain", "messages": ASK},
             {"custom_id": "thinks", "messages": ASK, "chat_template_kwargs": {"enable_thinking": True},
              "max_reasoning_tokens": 2},
             {"custom_id": "body", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": ASK, "max_tokens": 4}}]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["generate", str(src), "-o", str(out), "--model", str(model_dir), "--dtype", "float32",
            "--kv-cache-memory", "16MiB", "--max-tokens", "6", "--no-progress",
            "--chat-template-kwargs", '{"enable_thinking": false}']
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    got = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, out.read_text().splitlines())}
    for body in got.values():
        ChatCompletion.model_validate(body)
    assert "reasoning_content" not in got["plain"]["choices"][0]["message"]
    assert "reasoning_content" not in got["body"]["choices"][0]["message"]
    assert got["thinks"]["choices"][0]["message"]["reasoning_content"] is not None
    assert got["thinks"]["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3

    bad = CliRunner().invoke(cli, args[:-1] + ["[1]"])
    assert bad.exit_code == 2 and "--chat-template-kwargs" in bad.output and "Traceback" not in bad.output
