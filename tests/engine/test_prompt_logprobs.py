"""Prompt log-probabilities (issue 23, item 4) against a transformers forward pass's log_softmax on the same
tokens (float32), with and without prefix caching and with prompts cut into chunks; top-k alternatives
too. Then the same through a completions line (echo + logprobs, max_tokens 0; vLLM's prompt_logprobs) in
OpenAI's shape, validated with the openai package's types."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import fresh_seed, random_prompts
from openai.types import Completion as OpenAICompletion
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.openai_output import completion_body
from sluice.worker.convert import completion_to_result, job_to_request

TOL = 1e-4  # max abs difference allowed, float32 both sides
K = 3


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> object:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _validate(body: dict) -> None:
    """The openai package's Completion type, which has token_logprobs and top_logprobs entries non-null;
    OpenAI's API (and vLLM) give the echoed first prompt token null ones, as the issue asks: those two
    places are the only errors allowed."""
    from pydantic import ValidationError

    try:
        OpenAICompletion.model_validate(body)
    except ValidationError as e:
        places = {tuple(err["loc"]) for err in e.errors()}
        assert places <= {("choices", 0, "logprobs", "token_logprobs", 0),
                          ("choices", 0, "logprobs", "top_logprobs", 0)}, e


def _reference(hf: object, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)  # type: ignore[operator]


def _check(hf: object, prompt: list[int], got: list, k: int) -> tuple[float, int]:
    """Max abs difference of the prompt tokens' logprobs and the top-k's, and how many ranks are exact;
    the top-k ids and the ranks must match wherever the reference's own values are not a near-tie."""
    ref = _reference(hf, prompt)
    assert got[0] is None and len(got) == len(prompt)
    worst, exact_ranks = 0.0, 0
    for p in range(1, len(prompt)):
        e, row = got[p], ref[p - 1]
        assert e.token_id == prompt[p]
        worst = max(worst, abs(e.logprob - float(row[prompt[p]])))
        # The rank: 1 + how many tokens are likelier; a token within TOL of the prompt token may count
        # either way. A random model's logits are dense (a few tokens within TOL), so the ranks must
        # also be exact almost everywhere (checked by the caller).
        assert e.rank is not None
        assert 1 + int((row > row[prompt[p]] + TOL).sum()) <= e.rank <= 1 + int((row > row[prompt[p]] - TOL).sum())
        exact_ranks += e.rank == 1 + int((row > row[prompt[p]]).sum())
        top_lp, top_id = row.topk(k)
        assert len(e.top) == k
        worst = max(worst, max(abs(lp - float(r)) for (_, lp), r in zip(e.top, top_lp, strict=True)))
        for j, (tid, _) in enumerate(e.top):
            if tid != int(top_id[j]):
                assert abs(float(row[tid]) - float(top_lp[j])) <= TOL, f"position {p}: top-{j} differs"
    return worst, exact_ranks


@pytest.mark.parametrize(("prefix_caching", "budget"), [(True, 4096), (True, 24), (False, 24), (False, 4096)])
def test_prompt_logprobs_match_transformers(tiny_model_dir: Path, hf: object, prefix_caching: bool,
                                            budget: int) -> None:
    rng = random.Random(fresh_seed())
    shared = random_prompts(rng, 1, 40, 40)[0]  # a prefix the second wave finds cached
    prompts = [shared + p for p in random_prompts(rng, 4, 1, 30)] + random_prompts(rng, 2, 2, 50)
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=budget,
              enable_prefix_caching=prefix_caching, block_size=16)
    warm = llm.generate([Request("warm", prompt_token_ids=shared + [7, 8], params=SamplingParams(max_tokens=2))])
    assert warm[0].finish_reason == "length"
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=2, prompt_logprobs=K))
            for i, p in enumerate(prompts)]
    plain = Request("plain", prompt_token_ids=prompts[0], params=SamplingParams(max_tokens=2))
    done = {c.request_id: c for c in llm.generate([*reqs, plain])}
    checks = [_check(hf, r.prompt_token_ids or [], done[r.request_id].prompt_logprobs or [], K) for r in reqs]
    worst, exact = max(w for w, _ in checks), sum(e for _, e in checks)
    positions = sum(len(r.prompt_token_ids or []) - 1 for r in reqs)
    print(f"max abs diff vs transformers log_softmax: {worst:.2e}; exact ranks {exact}/{positions}")
    assert worst <= TOL
    assert exact >= 0.9 * positions
    assert done["plain"].prompt_logprobs is None
    assert done["plain"].token_ids == done["r0"].token_ids  # scoring changes nothing generated
    if prefix_caching:  # the plain request still takes the cached prefix; the scored ones recompute it
        assert done["plain"].usage.cached_tokens >= 32 and done["r0"].usage.cached_tokens == 0


def test_echo_logprobs_line_scores_without_generating(tiny_model_dir: Path, hf: object) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=16 << 20)
    text = "The quick brown fox jumps over the lazy dog"
    line = {"custom_id": "s", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": text, "echo": True, "logprobs": 1, "max_tokens": 0}}
    job = parse_line(json.dumps(line), 1)
    [c] = llm.generate([job_to_request(job)])
    body = completion_body(job, completion_to_result(job, c, llm.tokenizer))
    _validate(body)
    choice, ids = body["choices"][0], llm.tokenizer.encode(text)
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"] == {**body["usage"], "prompt_tokens": len(ids), "completion_tokens": 0}
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == text and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = _reference(hf, ids)
    diffs = [abs(lp["token_logprobs"][p] - float(ref[p - 1, ids[p]])) for p in range(1, len(ids))]
    assert max(diffs) <= TOL
    assert all(len(t) == 1 for t in lp["top_logprobs"][1:])

    # vLLM's prompt_logprobs: beside the choice, one entry per prompt token, the first null.
    vllm = {"custom_id": "v", "prompt": text, "prompt_logprobs": 2, "max_tokens": 1}
    job = parse_line(json.dumps(vllm), 2)
    [c] = llm.generate([job_to_request(job)])
    body = completion_body(job, completion_to_result(job, c, llm.tokenizer))
    OpenAICompletion.model_validate(body)
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert str(ids[3]) in plp[3] and abs(plp[3][str(ids[3])]["logprob"] - float(ref[2, ids[3]])) <= TOL


@pytest.mark.parametrize(("line", "message"), [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens 0"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1}, "prompt_logprobs is for"),
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_bad_scoring_lines_fail_their_line(line: dict, message: str) -> None:
    with pytest.raises(LineError) as e:
        parse_line(json.dumps(line), 3)
    assert message in str(e.value), str(e.value)
