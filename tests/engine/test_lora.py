"""LoRA adapters per request (issue 27): greedy output token-identical to peft's model on the same adapter
(float32), with rows of four adapters and the base mixed in every batch, on the native and the
transformers path, under preemption and chunked prefill; the prefix cache keyed by adapter; bad
adapters fail their requests only."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_greedy_matches, fresh_seed, hf_greedy, make_tiny_model, random_prompts
from lora_helpers import make_adapter, peft_model
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.kernels import cpu_ops
from transformers import AutoModelForCausalLM

pytest.importorskip("peft")

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# Four adapters of different ranks, alphas and target modules (one under rslora).
ADAPTERS = {
    "qv-r4": dict(r=4, targets=["q_proj", "v_proj"], alpha=8.0),
    "all-r8": dict(r=8, targets=ATTN + MLP, alpha=16.0),
    "mlp-r16-rslora": dict(r=16, targets=MLP + ["o_proj"], alpha=4.0, rslora=True),
    "k-up-r2": dict(r=2, targets=["k_proj", "up_proj"], alpha=32.0),
}
BASES = {
    "llama": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", head_dim=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}
MAX_NEW = 12


class Family:
    """A tiny base, its four adapters, and the references: transformers' base and peft's model per adapter."""

    def __init__(self, root: Path, kind: str) -> None:
        self.base = make_tiny_model(root / "base", seed=3, **BASES[kind])
        self.adapters = {name: make_adapter(self.base, root / name, seed=i, **spec)
                         for i, (name, spec) in enumerate(ADAPTERS.items())}
        self.refs: dict[str | None, Any] = {None: AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32).eval()}
        self.refs.update({name: peft_model(self.base, path) for name, path in self.adapters.items()})

    def llm(self, **config: Any) -> LLM:
        config.setdefault("kv_cache_memory", 16 << 20)
        return LLM(str(self.base), dtype="float32", lora_modules={k: str(v) for k, v in self.adapters.items()},
                   **config)


@pytest.fixture(scope="module", params=list(BASES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return Family(tmp_path_factory.mktemp(f"lora-{request.param}"), request.param)


def _mixed(prompts: list[list[int]]) -> list[tuple[str | None, list[int]]]:
    """Each prompt with an adapter: the four adapters and the base in turn, so every batch mixes them."""
    names: list[str | None] = [None, *ADAPTERS]
    return [(names[i % len(names)], p) for i, p in enumerate(prompts)]


def _run_and_compare(fam: Family, llm: LLM, rows: list[tuple[str | None, list[int]]], max_new: int = MAX_NEW) -> None:
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=max_new), lora=name)
            for i, (name, p) in enumerate(rows)]
    for (name, p), c in zip(rows, llm.generate(reqs), strict=True):
        assert c.error is None, c.error
        ref = fam.refs[name]
        assert_greedy_matches(ref, p, c.token_ids, hf_greedy(ref, p, max_new))


def test_adapters_change_the_output(family: Family) -> None:
    """Without this the comparisons below could pass with the adapters ignored."""
    rng = random.Random(fresh_seed())
    p = random_prompts(rng, 1, 8, 20)[0]
    base = hf_greedy(family.refs[None], p, MAX_NEW)
    for name in ADAPTERS:
        assert hf_greedy(family.refs[name], p, MAX_NEW) != base, name


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_mixed_batch_matches_peft(family: Family, impl: str) -> None:
    rng = random.Random(fresh_seed())
    llm = family.llm(model_impl=impl)
    _run_and_compare(family, llm, _mixed(random_prompts(rng, 10, 1, 40)))
    assert llm.lora is not None and set(llm.lora.completion_tokens) == set(ADAPTERS)
    if cpu_ops.available()[0]:  # the C++ op served every hooked layer
        assert llm.lora.use_cpu_op and all(hook.stacked[1] is not None for hook in llm.lora.hooks.values())


def test_mixed_batch_on_the_matmul_fallback(family: Family) -> None:
    """Where the C++ ops are not built (the PyTorch attention fallback): a matmul pair per row group."""
    rng = random.Random(fresh_seed())
    llm = family.llm(attention_backend="torch")
    assert llm.lora is not None and not llm.lora.use_cpu_op
    _run_and_compare(family, llm, _mixed(random_prompts(rng, 10, 1, 40)))
    assert all(hook.stacked == ((), None) for hook in llm.lora.hooks.values())


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_mixed_batch_under_preemption(family: Family, impl: str) -> None:
    rng = random.Random(fresh_seed())
    # 10 blocks of 16 tokens (2 layers x K and V x 2 heads x 16 dims x 4 bytes per token). Prompts of 28-32
    # tokens take 2 blocks, so at most 5 run at once, and each grows past 32 tokens into a 3rd block: the 5
    # need 15 blocks, so the cache must overflow whatever the lengths drawn (with 20-40 tokens, a seed could
    # draw lengths that fit).
    llm = family.llm(model_impl=impl, kv_cache_memory=10 * 16 * 2 * 2 * 2 * 16 * 4, max_num_seqs=8,
                     block_size=16)
    assert llm.num_total_blocks == 10
    _run_and_compare(family, llm, _mixed(random_prompts(rng, 8, 28, 32)))
    assert llm.stats["preemptions"] > 0
    assert llm.num_free_blocks == llm.num_total_blocks


@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_mixed_batch_with_chunked_prefill(family: Family, impl: str) -> None:
    rng = random.Random(fresh_seed())
    llm = family.llm(model_impl=impl, max_num_batched_tokens=7)
    _run_and_compare(family, llm, _mixed(random_prompts(rng, 5, 10, 30)))


def test_mixed_batch_through_the_triton_kernel(family: Family) -> None:
    """The CUDA path's kernel (kernels/lora.py), here under TRITON_INTERPRET=1, in the engine."""
    rng = random.Random(fresh_seed())
    llm = family.llm(max_num_batched_tokens=32)
    assert llm.lora is not None
    llm.lora.use_kernel = True
    _run_and_compare(family, llm, _mixed(random_prompts(rng, 5, 5, 25)), max_new=6)
    assert all(hook.stacks for hook in llm.lora.hooks.values())  # every hooked layer went through the kernel


def test_prefix_is_not_shared_across_adapters(family: Family) -> None:
    rng = random.Random(fresh_seed())
    prefix = random_prompts(rng, 1, 48, 48)[0]
    a, b = "qv-r4", "all-r8"
    llm = family.llm()
    first = [(a, prefix + [101])]
    _run_and_compare(family, llm, first)
    assert llm.stats["prefix_cache_hit_tokens"] == 0
    # Same prefix, another adapter: nothing found (its KV under adapter a is not adapter b's).
    _run_and_compare(family, llm, [(b, prefix + [102])])
    assert llm.stats["prefix_cache_hit_tokens"] == 0
    # ... nor under the base; under adapter a again, the prefix's full blocks are found.
    _run_and_compare(family, llm, [(None, prefix + [103])])
    assert llm.stats["prefix_cache_hit_tokens"] == 0
    _run_and_compare(family, llm, [(a, prefix + [104])])
    block = llm.config.block_size
    assert llm.stats["prefix_cache_hit_tokens"] == len(prefix) // block * block > 0


def test_max_loras_bounds_the_adapters_in_memory_and_in_a_batch(family: Family) -> None:
    rng = random.Random(fresh_seed())
    llm = family.llm(max_loras=2)
    _run_and_compare(family, llm, _mixed(random_prompts(rng, 10, 5, 30)))
    assert llm.lora is not None and len(llm.lora.cache.resident) <= 2


def test_bad_adapters_fail_their_requests_only(family: Family, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "other", seed=5, hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    wrong_base = make_adapter(other, tmp_path / "wrong-base", seed=9, r=4, targets=["q_proj"])
    dora = tmp_path / "dora"
    make_adapter(family.base, dora, seed=9, r=4, targets=["q_proj"])
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    corrupt = make_adapter(family.base, tmp_path / "corrupt", seed=9, r=2, targets=["q_proj"])
    (corrupt / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    paths = {"ok": str(family.adapters["qv-r4"]), "wrong-base": str(wrong_base), "dora": str(dora),
             "missing": str(tmp_path / "nowhere"), "corrupt": str(corrupt)}
    llm = LLM(str(family.base), dtype="float32", kv_cache_memory=16 << 20, lora_modules=paths, max_lora_rank=2)
    p = [5, 6, 7, 8]
    reqs = [Request(name, prompt_token_ids=p, params=SamplingParams(max_tokens=4), lora=name)
            for name in ["ok", "wrong-base", "dora", "missing", "corrupt", "unknown"]]
    reqs.append(Request("base", prompt_token_ids=p, params=SamplingParams(max_tokens=4)))
    out = {c.request_id: c for c in llm.generate(reqs)}
    assert "rank 4 > max_lora_rank 2" in (out["ok"].error or "")
    assert "another base model" in (out["wrong-base"].error or "")
    assert "DoRA" in (out["dora"].error or "")
    assert "no adapter_config.json" in (out["missing"].error or "")
    assert "cannot read" in (out["corrupt"].error or "")
    assert "unknown LoRA adapter 'unknown'" in (out["unknown"].error or "")
    assert out["base"].error is None
    assert out["base"].token_ids == hf_greedy(family.refs[None], p, 4)
