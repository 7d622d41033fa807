"""Sampling: seeds, filters, penalties, stops, n > 1, logprobs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from helpers import fresh_seed, random_prompts, smollm2_tokenizer
from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampler import _filter
from sluice.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=16 << 20)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch_of_32(llm: LLM) -> None:
    rng = random.Random(fresh_seed())
    prompt = random_prompts(rng, 1, 5, 20)[0]
    params = dict(max_tokens=20, temperature=1.0, top_p=0.95, seed=rng.randrange(10**6), ignore_eos=True)
    alone = llm.generate([Request("x", prompt_token_ids=prompt, params=SamplingParams(**params))])[0]
    others = [Request(f"o{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.8))
              for i, p in enumerate(random_prompts(rng, 31, 1, 40))]
    batch = others[:15] + [Request("x", prompt_token_ids=prompt, params=SamplingParams(**params))] + others[15:]
    together = {c.request_id: c for c in llm.generate(batch)}["x"]
    assert together.token_ids == alone.token_ids
    assert together.text == alone.text
    # And the seed matters: another seed gives another sample.
    other = llm.generate([Request("y", prompt_token_ids=prompt, params=SamplingParams(**{**params, "seed": params["seed"] + 1}))])
    assert other[0].token_ids != alone.token_ids


def test_top_k_1_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    rng = random.Random(fresh_seed())
    prompts = random_prompts(rng, 4, 3, 30)
    greedy = llm.generate([Request(f"g{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=10)) for i, p in enumerate(prompts)])
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        sampled = llm.generate([Request(f"s{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=10, temperature=1.5, **kw))
                                for i, p in enumerate(prompts)])
        assert [c.token_ids for c in sampled] == [c.token_ids for c in greedy], kw


def test_filter_keeps_exactly_the_nucleus() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    seq = type("S", (), {})()
    seq.params = SamplingParams(temperature=1.0, top_p=0.8)
    assert (_filter(probs, [seq]) > 0).tolist() == [[True, True, False, False]]
    seq.params = SamplingParams(temperature=1.0, top_k=3, min_p=0.2)  # min_p: p >= 0.1
    assert (_filter(probs, [seq]) > 0).tolist() == [[True, True, True, False]]


def test_repetition_penalty_avoids_repeats(llm: LLM) -> None:
    prompt = [300] * 3
    plain = llm.generate([Request("a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=30, ignore_eos=True))])[0]
    penalised = llm.generate([Request("b", prompt_token_ids=prompt, params=SamplingParams(
        max_tokens=30, ignore_eos=True, repetition_penalty=100.0, frequency_penalty=100.0))])[0]
    assert len(set(penalised.token_ids)) == 30, "every token penalised away after one use"
    assert len(set(plain.token_ids)) < 30 or plain.token_ids != penalised.token_ids


def test_min_tokens_and_stop_token_ids(llm: LLM) -> None:
    prompt = [400, 401, 402]
    first = llm.generate([Request("a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=10, ignore_eos=True))])[0]
    stop_at = first.token_ids[3]
    idx = first.token_ids.index(stop_at)
    out = llm.generate([Request("b", prompt_token_ids=prompt, params=SamplingParams(max_tokens=10, stop_token_ids=[stop_at]))])[0]
    assert out.finish_reason == "stop" and out.token_ids == first.token_ids[: idx + 1]
    held = llm.generate([Request("c", prompt_token_ids=prompt, params=SamplingParams(
        max_tokens=10, min_tokens=8, stop_token_ids=[stop_at], ignore_eos=True))])[0]
    assert len(held.token_ids) >= 8 and stop_at not in held.token_ids[:8]


def test_n_samples_share_the_prompt_blocks_and_logprobs(llm: LLM) -> None:
    prompt = list(range(1000, 1064))  # whole blocks (of 16 or 32)
    block = llm.config.block_size
    before = llm.stats["prefix_cache_hit_tokens"]
    out = llm.generate([Request("n", prompt_token_ids=prompt, params=SamplingParams(
        max_tokens=8, temperature=1.0, seed=7, n=3, logprobs=2, ignore_eos=True))])[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "different samples"
    # Samples 2 and 3 reuse the prompt's full blocks but the last one, whose last token they compute.
    reused = (len(prompt) - 1) // block * block
    assert llm.stats["prefix_cache_hit_tokens"] - before >= 2 * reused > 0, "samples 2 and 3 reuse the prompt's blocks"
    lp = out.outputs[0].logprobs
    assert lp is not None and len(lp) == 8
    assert all(len(x.top) == 2 and x.top[0][1] >= x.top[1][1] and x.logprob <= 0 for x in lp)
    assert out.usage.completion_tokens == 24


def test_stop_string_excluded_and_split_characters_wait() -> None:
    tok = smollm2_tokenizer()
    text = "Bonjour 🙂 le café, STOP here"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, [], ["STOP"])
    pieces, stopped = [], False
    for i in range(1, len(ids) + 1):
        before = det.text
        stopped = det.update(ids[:i])
        pieces.append(det.text[len(before):])
        assert "\ufffd" not in det.text
        if stopped:
            break
    assert stopped
    assert det.text == "Bonjour 🙂 le café, "


def test_stop_string_in_generation(llm: LLM) -> None:
    prompt = [500, 501]
    first = llm.generate([Request("a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=12, ignore_eos=True))])[0]
    assert len(first.text) > 6
    stop = first.text[3:6]
    out = llm.generate([Request("b", prompt_token_ids=prompt, params=SamplingParams(max_tokens=12, stop=[stop], ignore_eos=True))])[0]
    assert out.finish_reason == "stop"
    assert out.text == first.text[: first.text.find(stop)]


@pytest.mark.parametrize("first_max", ["torch", "cpp"])
def test_greedy_takes_the_first_of_tied_maxima(first_max: str) -> None:
    """As transformers' argmax does: on a tie the lowest token id wins (greedy parity depends on it); with
    torch's max and with the C++ argmax the runner passes on CPU."""
    from sluice.engine.sampler import sample
    from sluice.engine.sequence import Sequence
    from sluice.kernels import cpu_fused

    rng = random.Random(fresh_seed())
    vocab = 49152
    seqs = [Sequence(i, f"r{i}", 0, [1, 2, 3], 3, SamplingParams()) for i in range(8)]
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    firsts = []
    for row in range(len(seqs)):
        tied = sorted(rng.sample(range(vocab), rng.randint(2, 5)))
        logits[row, tied] = 100.0
        firsts.append(tied[0])
    kernels = cpu_fused if first_max == "cpp" else None
    assert sample(logits, seqs, [set() for _ in seqs], kernels).token_ids == firsts


def test_cpp_argmax_is_torch_max_on_ties_nan_and_infinities() -> None:
    """kernels/cpu/argmax.cpp against ``max(dim=-1).indices``: small integer logits (ties everywhere),
    rows of -inf, +inf, NaN (torch's max returns the first NaN), widths around the 16-lane chunks."""
    from sluice.kernels.cpu_fused import argmax

    rng = random.Random(fresh_seed())
    for _ in range(100):
        rows, width = rng.randint(1, 12), rng.choice([1, 5, 15, 16, 17, 33, 1000, 49152])
        logits = torch.randint(-3, 4, (rows, width), generator=torch.Generator().manual_seed(rng.randrange(2**31)))
        logits = logits.float()
        if rng.random() < 0.3:
            logits[rng.randrange(rows), rng.randrange(width)] = float("nan")
        if rng.random() < 0.2:
            logits[rng.randrange(rows)] = float("-inf")
        if rng.random() < 0.2:
            logits[rng.randrange(rows), rng.randrange(width)] = float("inf")
        assert torch.equal(argmax(logits), logits.max(dim=-1).indices), logits
