"""Decode steps padded to fixed batch sizes (engine/graph_runner.py), run eagerly on CPU: the same
tokens as unpadded steps, greedy and seeded sampling, on the PyTorch and the Triton (interpreted)
backends; and the start-up warm-up that sizes the KV cache on CUDA, run on CPU."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_greedy_matches, fresh_seed, hf_greedy, random_prompts
from sluice.engine.graph_runner import bucket_for, decode_buckets
from sluice.engine.llm import LLM
from sluice.engine.model_runner import cuda_kv_budget, warmup_query_lens
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams


def test_decode_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(16) == [1, 2, 4, 8, 16]
    assert decode_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert decode_buckets(256) == [1, 2, 4, 8, 16, *range(32, 257, 16)]
    assert [bucket_for(n, decode_buckets(40)) for n in (1, 3, 5, 16, 17, 33, 40)] == [1, 4, 8, 16, 32, 40, 40]


def _requests(rng: random.Random, n: int) -> list[Request]:
    """Greedy and seeded sampling, each request a different length, so the batch shrinks one row at a
    time through every bucket (random lengths could end many together: a seed left the batch at >= 5)."""
    reqs = []
    lengths = rng.sample(range(2, 2 + n), n)
    for i, prompt in enumerate(random_prompts(rng, n, 1, 40)):
        kind = i % 3
        params = SamplingParams(max_tokens=lengths[i], ignore_eos=True)
        if kind == 1:
            params = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True, temperature=0.9, top_p=0.9,
                                    seed=rng.randrange(10**6))
        elif kind == 2:
            params = SamplingParams(max_tokens=params.max_tokens, ignore_eos=True, temperature=1.3, top_k=20,
                                    repetition_penalty=1.2, seed=rng.randrange(10**6), logprobs=2)
        reqs.append(Request(f"r{i}", prompt_token_ids=prompt, params=params))
    return reqs


def _generate(model_dir: Path, reqs: list[Request], **kw: Any) -> tuple[list[Any], LLM]:
    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=12, **kw)
    return llm.generate(reqs), llm


def test_padded_decode_matches_unpadded(tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    reqs = _requests(rng, 14)
    plain, plain_llm = _generate(tiny_model_dir, reqs, pad_decode=False)
    padded, llm = _generate(tiny_model_dir, reqs, pad_decode=True)
    assert plain_llm.runner.decode_runner is None
    runner = llm.runner.decode_runner
    assert runner is not None and runner.buckets == [1, 2, 4, 8, 12]
    # Batches of 12 down to 1 ran through several buckets, padded rows included (e.g. 3 -> 4).
    assert sum(1 for n in runner.steps.values() if n) >= 3, runner.steps
    for a, b in zip(plain, padded, strict=True):
        assert a.token_ids == b.token_ids, a.request_id
        assert [x.token_id for x in a.outputs[0].logprobs or []] == [x.token_id for x in b.outputs[0].logprobs or []]


def test_padded_decode_on_the_triton_backend(tiny_model_dir: Path) -> None:
    """Padded rows (slot -1, context 0) through the interpreted kernels: greedy tokens as transformers'."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(fresh_seed())
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(rng, 3, 1, 30)
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=6)) for i, p in enumerate(prompts)]
    outs, llm = _generate(tiny_model_dir, reqs, pad_decode=True, attention_backend="triton")
    assert llm.runner.decode_runner is not None and llm.runner.decode_runner.steps[4] > 0  # 3 rows + 1 pad
    for p, c in zip(prompts, outs, strict=True):
        assert_greedy_matches(hf, p, c.token_ids, hf_greedy(hf, p, 6))


def test_warmup_step_stays_inside_the_rotary_tables(tiny_model_dir: Path) -> None:
    """The sizing warm-up runs the largest step as prompt chunks no longer than max_model_len (it used
    to run positions 0..max_num_batched_tokens-1, past the rotary tables)."""
    assert warmup_query_lens(300, 64) == [64, 64, 64, 64, 44]
    assert warmup_query_lens(128, 64) == [64, 64]
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=16 << 20, max_model_len=64,
              max_num_batched_tokens=300, block_size=16)
    assert llm.runner.model.rotary.cos.shape[0] == 64
    blocks = llm.runner.warmup_step()
    assert blocks == 4 * 4 + 3  # 64-token chunks take 4 blocks of 16, the 44-token rest 3


def test_cuda_budget_after_warmup_with_a_fake_device(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA sizing path, on CPU with torch.cuda's memory counters faked: an 80 GiB device at
    utilization 0.9 (72 GiB) where another process holds 16 GiB and the weights 4: 60 GiB are free. The
    warm-up peaks 2 GiB above what stays allocated, so 72 - 20 - 2 = 50 GiB are left for the KV cache
    (sizing from total x utilization less the peak gave 66 GiB: more than was free)."""
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=16 << 20, max_model_len=64,
              max_num_batched_tokens=200, gpu_memory_utilization=0.9)
    runner = llm.runner
    calls: list[str] = []
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 6 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 4 * gib)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * gib, 80 * gib))
    assert runner._cuda_free_after_warmup() == int(0.9 * 80 * gib) - 20 * gib - 2 * gib
    assert calls == ["reset", "empty"] and runner.kv_caches == []


def test_cuda_kv_budget_leaves_others_memory_and_the_graph_reserve() -> None:
    gib = 1 << 30
    assert cuda_kv_budget(80 * gib, 80 * gib, 0.5, 0, 0) == 40 * gib
    assert cuda_kv_budget(60 * gib, 80 * gib, 0.5, 0, 0) == 20 * gib  # 20 GiB held by anyone counts
    assert cuda_kv_budget(60 * gib, 80 * gib, 0.5, 3 * gib, gib) == 16 * gib
    assert cuda_kv_budget(10 * gib, 80 * gib, 0.5, 0, 0) == 0  # nothing left: never negative


def test_transformers_path_decodes_past_the_step_token_budget(tiny_model_dir: Path) -> None:
    """On the transformers path the padded decode's block tables are sized from the engine's length limit
    (the model's 4096 here), not max_num_batched_tokens (16): sequences grow to ~28 tokens, two 16-token
    blocks."""
    from transformers import AutoModelForCausalLM

    rng = random.Random(fresh_seed())
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(rng, 2, 10, 14)
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=14)) for i, p in enumerate(prompts)]
    outs, llm = _generate(tiny_model_dir, reqs, pad_decode=True, model_impl="transformers",
                          max_num_batched_tokens=16, attention_backend="torch", block_size=16)
    assert llm.model_impl == "transformers" and llm.runner.max_model_len == 4096
    runner = llm.runner.decode_runner
    assert runner is not None and runner.inputs.tables.shape[1] == 4096 // 16  # the length limit, not 1 block
    assert runner.inputs.table_copy_elems <= 2 * 2  # the last step sent its rows' used columns only
    for p, c in zip(prompts, outs, strict=True):
        assert len(p) + len(c.token_ids) > 16
        assert_greedy_matches(hf, p, c.token_ids, hf_greedy(hf, p, 14))


def test_a_failed_capture_falls_back_to_eager_steps(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """A capture that fails (a host sync inside the model, simulated: this machine has no CUDA) leaves no
    graph behind, is logged, and the engine starts and decodes eagerly, padded, to the same tokens."""
    from sluice.engine.graph_runner import DecodeGraphRunner
    from sluice.engine.model_runner import ModelRunner

    def broken_capture(self: DecodeGraphRunner) -> None:
        self.graphs[self.buckets[-1]] = object()  # one bucket captured before the failure
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    rng = random.Random(fresh_seed())
    reqs = _requests(rng, 5)
    plain, _ = _generate(tiny_model_dir, reqs, pad_decode=False)
    monkeypatch.setattr(ModelRunner, "_capture_graphs", lambda self: True)
    monkeypatch.setattr(DecodeGraphRunner, "_capture_all", broken_capture)
    with caplog.at_level("WARNING", logger="sluice.engine.graph_runner"):
        outs, llm = _generate(tiny_model_dir, reqs)
    runner = llm.runner.decode_runner
    assert runner is not None and runner.graphs == {} and sum(runner.steps.values()) > 0
    assert runner.capture_error == "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert "capture failed" in caplog.text
    for a, b in zip(plain, outs, strict=True):
        assert a.token_ids == b.token_ids, a.request_id
