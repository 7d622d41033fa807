"""Scheduler and block manager behaviour a user would notice: finished sequences leave at once,
nothing leaks under random aborts, and a request that can never fit fails alone."""

from __future__ import annotations

import random
from pathlib import Path

from helpers import fresh_seed, random_prompts
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams


def _req(rid: str, prompt: list[int], max_tokens: int, **kw: object) -> Request:
    return Request(rid, prompt_token_ids=prompt, params=SamplingParams(max_tokens=max_tokens, **kw))


def test_finished_sequence_leaves_in_the_same_step(tiny_model_dir: Path) -> None:
    # Two slots for three requests: the third must wait for the first to finish.
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=2)
    llm.add_request(_req("short", [100, 200, 300], 2, ignore_eos=True))
    llm.add_request(_req("long", [100, 200, 301], 10, ignore_eos=True))
    llm.add_request(_req("waiting", [5000] * 3, 3, ignore_eos=True))
    finished: dict[str, int] = {}
    step = 0
    while llm.has_unfinished():
        step += 1
        for c in llm.step():
            finished[c.request_id] = step
            assert all(s.request_id != c.request_id for s in llm.scheduler.running)
    assert finished["short"] == 2  # prefill step gives token 1, the next step token 2 and the finish
    assert finished["waiting"] == finished["short"] + 3
    assert llm.num_free_blocks == llm.num_total_blocks


def test_thousand_random_requests_with_aborts_leak_no_block(tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=2 << 20, max_num_seqs=64,
              max_num_batched_tokens=256)
    system = random_prompts(rng, 1, 32, 32)[0]
    prompts = random_prompts(rng, 1000, 1, 40)
    live: list[str] = []
    done = 0
    for i, p in enumerate(prompts):
        prompt = system + p if rng.random() < 0.3 else p  # some share a prefix, so blocks get shared
        llm.add_request(_req(f"r{i}", prompt, rng.randint(1, 12), n=rng.choice([1, 1, 1, 2])))
        live.append(f"r{i}")
        if i % 10 == 9:
            for _ in range(rng.randint(0, 3)):
                done += len(llm.step())
            for rid in rng.sample(live, k=min(2, len(live))):
                if rng.random() < 0.5 and llm.abort(rid) is not None:
                    done += 1
    while llm.has_unfinished():
        done += len(llm.step())
    assert done == 1000
    assert llm.num_free_blocks == llm.num_total_blocks
    assert all(b.ref_count == 0 for b in llm.block_manager.blocks)
    assert llm.stats["prefix_cache_hit_tokens"] > 0


def test_oversize_request_is_rejected_and_the_rest_complete(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=1 << 20, max_model_len=512)
    reqs = [_req("ok1", [100] * 10, 5), _req("too-long", [100] * 500, 100), _req("ok2", [200] * 10, 5),
            _req("bad-token", [10**9], 5), Request("empty", prompt_token_ids=[])]
    out = {c.request_id: c for c in llm.generate(reqs)}
    assert out["too-long"].finish_reason == "error" and "max_model_len" in (out["too-long"].error or "")
    assert out["bad-token"].finish_reason == "error"
    assert out["empty"].finish_reason == "error"
    assert out["ok1"].error is None and len(out["ok1"].token_ids) >= 1
    assert out["ok2"].error is None
    assert llm.num_free_blocks == llm.num_total_blocks


def test_request_larger_than_the_whole_cache_is_rejected(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=4 * 2 * 2 * 16 * 2 * 16 * 4, block_size=16)
    assert llm.num_total_blocks == 4
    out = llm.generate([_req("big", [100] * 60, 20), _req("small", [100] * 5, 3)])
    assert out[0].finish_reason == "error" and "KV blocks" in (out[0].error or "")
    assert out[1].error is None


def test_static_policy_runs_cohorts(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=2, policy="static")
    reqs = [_req("a", [100] * 4, 2, ignore_eos=True), _req("b", [101] * 4, 8, ignore_eos=True),
            _req("c", [102] * 4, 2, ignore_eos=True)]
    for r in reqs:
        llm.add_request(r)
    order: list[str] = []
    while llm.has_unfinished():
        order += [c.request_id for c in llm.step()]
        # While b of the first cohort still runs, c may not start although a slot is free.
        if "a" in order and "b" not in order:
            assert all(s.request_id != "c" for s in llm.scheduler.running)
    assert order == ["a", "b", "c"]
