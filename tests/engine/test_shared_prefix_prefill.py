"""Issue 44: requests that share a prefix not yet cached, submitted at once, prefill it once.

The block manager publishes a block to the prefix cache when it is allocated for a step (its KV is written
in that step before any layer reads it), and the scheduler admits waiting requests only after every running
one has its chunk: so a follower is admitted only once its leader's whole prompt is scheduled, and finds
every shared block. These tests pin that down on the tiny random model: computed prompt tokens (the usage's
prompt - cached, as bench/prefix_plan.py counts them), greedy outputs against one-by-one runs and
transformers, a leader aborted or preempted mid-prefill, chunked prefill, and unrelated requests that are not
held back."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_greedy_matches, fresh_seed, hf_greedy, random_prompts
from sluice.engine.llm import LLM
from sluice.engine.outputs import Completion, Request
from sluice.engine.sampling_params import SamplingParams
from transformers import AutoModelForCausalLM

BLOCK = 16
PREFIX_BLOCKS = 12  # a long shared prefix: 192 tokens
MAX_NEW = 6


def _llm(path: Path, budget: int, **kw: Any) -> LLM:
    return LLM(str(path), dtype="float32", kv_cache_memory=kw.pop("kv", 8 << 20), block_size=BLOCK,
               max_num_batched_tokens=budget, **kw)


def _req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    prefix = random_prompts(rng, 1, PREFIX_BLOCKS * BLOCK, PREFIX_BLOCKS * BLOCK)[0]
    return [prefix + suffix for suffix in random_prompts(rng, n, 3, 20)]


def _computed(outs: list[Completion]) -> int:
    return sum(c.usage.prompt_tokens - c.usage.cached_tokens for c in outs)


def _minimum(prompts: list[list[int]]) -> int:
    """The shared prefix once, plus every prompt's own suffix."""
    return PREFIX_BLOCKS * BLOCK + sum(len(p) - PREFIX_BLOCKS * BLOCK for p in prompts)


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


# 4096: every prompt fits one step; 64 and 50: the leader's prefill takes several chunks (50: chunks that
# end inside a block).
@pytest.mark.parametrize("budget", [4096, 64, 50])
def test_a_prefix_shared_by_requests_submitted_at_once_is_computed_once(tiny_model_dir: Path, hf: Any,
                                                                         budget: int) -> None:
    rng = random.Random(fresh_seed())
    prompts = _prompts(rng, 6)
    llm = _llm(tiny_model_dir, budget)
    outs = llm.generate([_req(f"r{i}", p) for i, p in enumerate(prompts)])
    assert [c.error for c in outs] == [None] * len(prompts)
    assert _computed(outs) == _minimum(prompts)
    assert llm.stats["prompt_tokens"] - llm.stats["prefix_cache_hit_tokens"] == _minimum(prompts)
    alone = [_llm(tiny_model_dir, budget, enable_prefix_caching=False).generate([_req("x", p)])[0] for p in prompts[:2]]
    for c, a in zip(outs, alone, strict=False):
        assert c.token_ids == a.token_ids  # greedy: token-identical to the request run by itself
    for p, c in zip(prompts, outs, strict=True):
        assert_greedy_matches(hf, p, c.token_ids, hf_greedy(hf, p, MAX_NEW))
    assert llm.num_free_blocks == llm.num_total_blocks


def _step_until(llm: LLM, done: dict[str, Completion], cond: Any) -> None:
    for _ in range(1000):
        if cond():
            return
        for c in llm.step():
            assert c.request_id not in done, f"{c.request_id} finished twice"
            done[c.request_id] = c
    raise AssertionError("the condition never held")


def test_followers_complete_once_when_the_leader_is_aborted_mid_prefill(tiny_model_dir: Path, hf: Any) -> None:
    rng = random.Random(fresh_seed())
    prompts = _prompts(rng, 4)
    llm = _llm(tiny_model_dir, 48)  # the leader's 200-odd prompt tokens take five steps
    for i, p in enumerate(prompts):
        llm.add_request(_req(f"r{i}", p))
    done: dict[str, Completion] = {}
    leader = llm.requests["r0"].seqs[0]
    _step_until(llm, done, lambda: 0 < leader.num_computed_tokens < PREFIX_BLOCKS * BLOCK)
    assert llm.abort("r0") is not None
    _step_until(llm, done, lambda: not llm.has_unfinished())
    assert sorted(done) == ["r1", "r2", "r3"]
    for i in (1, 2, 3):
        assert done[f"r{i}"].error is None
        assert_greedy_matches(hf, prompts[i], done[f"r{i}"].token_ids, hf_greedy(hf, prompts[i], MAX_NEW))
    assert llm.num_free_blocks == llm.num_total_blocks
    assert all(b.ref_count == 0 for b in llm.block_manager.blocks)


def test_followers_complete_once_when_the_leader_is_preempted_mid_prefill(tiny_model_dir: Path, hf: Any) -> None:
    rng = random.Random(fresh_seed())
    prompts = _prompts(rng, 3)
    llm = _llm(tiny_model_dir, 48)
    for i, p in enumerate(prompts):
        llm.add_request(_req(f"r{i}", p))
    done: dict[str, Completion] = {}
    leader = llm.requests["r0"].seqs[0]
    _step_until(llm, done, lambda: 0 < leader.num_computed_tokens < PREFIX_BLOCKS * BLOCK)
    sched = llm.scheduler
    sched.running.remove(leader)
    sched._preempt(leader)  # what a full cache does to the newest running sequence
    _step_until(llm, done, lambda: not llm.has_unfinished())
    assert sorted(done) == ["r0", "r1", "r2"]
    for i, p in enumerate(prompts):
        assert done[f"r{i}"].error is None
        assert_greedy_matches(hf, p, done[f"r{i}"].token_ids, hf_greedy(hf, p, MAX_NEW))
    assert llm.num_free_blocks == llm.num_total_blocks


def test_a_request_without_the_shared_prefix_is_admitted_in_the_same_step(tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    shared = _prompts(rng, 3)
    other = random_prompts(rng, 1, 20, 20)[0]
    llm = _llm(tiny_model_dir, 4096)
    for i, p in enumerate(shared):
        llm.add_request(_req(f"s{i}", p))
    llm.add_request(_req("other", other))
    llm.step()
    # One step admits them all: the followers hit the leader's blocks published in this very step, and the
    # unrelated request is not held behind them.
    assert {s.request_id for s in llm.scheduler.running} == {"s0", "s1", "s2", "other"}
    assert [s.num_cached_tokens for s in llm.scheduler.running] == [0, PREFIX_BLOCKS * BLOCK, PREFIX_BLOCKS * BLOCK, 0]
    done: dict[str, Completion] = {}
    _step_until(llm, done, lambda: not llm.has_unfinished())
    assert sorted(done) == ["other", "s0", "s1", "s2"]
    assert llm.num_free_blocks == llm.num_total_blocks
