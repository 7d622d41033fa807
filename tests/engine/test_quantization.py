"""Quantized weights (engine/quant/): int8 weight-only on the native path (quantized at load, or read from a
compressed-tensors checkpoint the test saves) and torchao's int8 through transformers, each against
transformers' generate on the dequantized weights (the same values in float32), over 64 prompts; and the
KV cache sized from the weights' real bytes, so the memory int8 saves becomes KV blocks."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    assert_greedy_matches,
    engine_backends,
    fresh_seed,
    make_tiny_model,
    random_prompts,
)
from sluice.engine.llm import LLM
from sluice.engine.models.base import UnsupportedModelError
from sluice.engine.outputs import Request
from sluice.engine.quant.int8 import INT8PACK_MAX_ROWS, Int8Linear, quantize_per_channel, quantize_with_scale
from sluice.engine.quant.methods import pick_impl, plan_quantization
from sluice.engine.quant.weight_bytes import weight_bytes
from sluice.engine.sampling_params import SamplingParams
from torch import nn
from transformers import AutoModelForCausalLM

pytest.importorskip("torchao")
NUM_PROMPTS, MAX_NEW, VOCAB = 64, 12, 1024
BACKEND = engine_backends(["torch"])[0]  # the PyTorch attention: nothing to build; Triton on a GPU
TOL = 1e-3  # a differing greedy token must be a near-tie in the reference's logits


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A small vocabulary: 64 prompts' references run in seconds (the prompts are token ids below it).
    return make_tiny_model(tmp_path_factory.mktemp("quant") / "m", seed=3, hidden_size=128, intermediate_size=256,
                           vocab_size=VOCAB)


def _engine(path: Path, **kw: Any) -> LLM:
    kw.setdefault("kv_cache_memory", 32 << 20)
    return LLM(str(path), dtype="float32", attention_backend=BACKEND, cpu_linear="aten", max_num_seqs=16, **kw)


def _agreement(llm: LLM, ref: Any, seed: int) -> int:
    """Every prompt's greedy tokens against ``ref`` (identical, or a near-tie: asserted); returns how many of
    the prompts are token-identical to ``ref`` (printed)."""
    prompts = random_prompts(random.Random(seed), NUM_PROMPTS, 1, 40, vocab=VOCAB)
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=MAX_NEW)) for i, p in enumerate(prompts)]
    same = 0
    for p, c, want in zip(prompts, llm.generate(reqs), _hf_greedy_batch(ref, prompts), strict=True):
        assert c.error is None
        assert_greedy_matches(ref, p, c.token_ids, want, tol=TOL)
        same += c.token_ids == want
    print(f"greedy tokens identical to the dequantized reference on {same} of {NUM_PROMPTS} prompts "
          f"({MAX_NEW} tokens each; the rest differ first at an asserted near-tie)")
    return same


def _hf_greedy_batch(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate on all prompts at once (left-padded: one call, not 64), each cut after
    its first end-of-sequence token as a lone prompt's generate stops there."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    rows = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:end])
    return rows


def _dequantized_reference(path: Path) -> Any:
    """transformers' model with every decoder linear weight replaced by its int8 per-channel value
    (absmax / 127 scales, written out here rather than taken from the engine)."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in hf.model.layers:
            for m in layer.modules():
                if isinstance(m, nn.Linear):
                    scale = m.weight.abs().amax(dim=1, keepdim=True) / 127
                    m.weight.copy_(torch.round(m.weight / scale).clamp(-127, 127) * scale)
    return hf


# ---- the int8 layer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, INT8PACK_MAX_ROWS, INT8PACK_MAX_ROWS + 1, 64])
def test_int8_linear_computes_with_its_dequantized_weight(dtype: torch.dtype, rows: int) -> None:
    """Both GEMMs (ATen's int8 kernel at few rows in bfloat16, dequantize-on-the-fly otherwise) against a
    dense GEMM on the dequantized weight."""
    gen = torch.Generator().manual_seed(fresh_seed())
    dense = nn.Linear(96, 80, bias=True, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(80, 96, generator=gen))
    layer = Int8Linear.from_linear(dense)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() == 127
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    want = (x.float() @ layer.dequantized().float().T + dense.bias.detach().float()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(layer(x), want, rtol=tol, atol=tol * float(want.abs().max()))


def test_requantizing_an_int8_weight_gives_back_the_same_integers() -> None:
    """Why a compressed-tensors int8 checkpoint read back dequantized loses nothing on the native path: its
    own scales divide its values out exactly, whatever convention chose them (its absmax / 127.5 uses -128);
    and absmax / 127 reproduces a weight quantized that way."""
    gen = torch.Generator().manual_seed(fresh_seed())
    q = torch.randint(-128, 128, (64, 48), generator=gen, dtype=torch.int8)
    scale = torch.rand(64, generator=gen) + 0.01
    assert torch.equal(quantize_with_scale(q.float() * scale[:, None], scale), q)
    q = q.clamp(-127, 127)
    q[:, 0] = 127  # absmax / 127 is then the scale
    q2, scale2 = quantize_per_channel(q.float() * scale[:, None])
    assert torch.equal(q2, q)
    torch.testing.assert_close(scale2, scale)


# ---- generation against the dequantized reference -----------------------------------------------
def test_native_int8_at_load_matches_the_dequantized_reference(tiny: Path) -> None:
    llm = _engine(tiny, quantization="int8")
    assert llm.model_impl == "native" and llm.quantization == "int8"
    assert sum(isinstance(m, Int8Linear) for m in llm.runner.model.modules()) == 2 * 4  # qkv, o, gate_up, down
    same = _agreement(llm, _dequantized_reference(tiny), fresh_seed())
    assert same >= NUM_PROMPTS - 4  # the rest are asserted near-ties


def test_torchao_int8_on_the_transformers_path_matches_the_dequantized_reference(tiny: Path) -> None:
    from torchao.quantization import Int8Tensor

    llm = _engine(tiny, quantization="int8", model_impl="transformers")
    assert llm.model_impl == "transformers" and llm.quantization == "int8"
    hf = llm.runner.model.hf  # type: ignore[union-attr]
    weights = [m.weight for m in hf.model.layers.modules() if isinstance(m, nn.Linear)]
    assert weights and all(isinstance(w, Int8Tensor) for w in weights)
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():  # torchao's own dequantization of the weights the engine runs
        for name, m in hf.model.layers.named_modules():
            if isinstance(m, nn.Linear):
                ref.model.layers.get_submodule(name).weight.copy_(m.weight.dequantize())
    same = _agreement(llm, ref, fresh_seed())
    assert same >= NUM_PROMPTS - 4


def _save_compressed_tensors_int8(src: Path, out: Path) -> Path:
    """A compressed-tensors checkpoint of ``src``: int8 weights with one symmetric scale per output channel
    (activations not quantized), scales by compressed-tensors' own ``calculate_qparams``, the head left dense."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "quantization_scheme", None) is not None:
                w = m.weight
                scale, zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), weights)
                m.weight_scale.copy_(scale.reshape(m.weight_scale.shape))
                m.weight_zero_point.copy_(zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).exists():
            (out / f).write_bytes((src / f).read_bytes())
    return out


def test_compressed_tensors_int8_checkpoint_runs_native_int8(tiny: Path, tmp_path: Path) -> None:
    pytest.importorskip("compressed_tensors")
    ckpt = _save_compressed_tensors_int8(tiny, tmp_path / "ct")
    llm = _engine(ckpt)
    assert llm.model_impl == "native" and llm.quantization == "compressed-tensors:int8-channel"
    # The checkpoint's own dequantized weights (transformers decompresses them) are the reference.
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    same = _agreement(llm, ref, fresh_seed())
    assert same >= NUM_PROMPTS - 4
    # The engine's int8 values and scales are the checkpoint's (q/k/v fused along the output rows).
    net = llm.runner.model
    ours = net.layers[0].self_attn.qkv_proj.dequantized()  # type: ignore[union-attr, operator]
    theirs = torch.cat([ref.model.layers[0].self_attn.get_submodule(p).weight for p in ("q_proj", "k_proj", "v_proj")])
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)


# ---- KV sizing ----------------------------------------------------------------------------------
def test_the_kv_cache_gets_the_memory_int8_frees(tiny: Path) -> None:
    budget = 16 << 20  # under the cap of max_num_seqs full-length sequences (4096 blocks)
    dense = _engine(tiny, kv_cache_memory=None, memory_budget=budget)
    int8 = _engine(tiny, kv_cache_memory=None, memory_budget=budget, quantization="int8")
    dense_bytes, int8_bytes = weight_bytes(dense.runner.model), weight_bytes(int8.runner.model)  # type: ignore[arg-type]
    # The decoder's linear weights: 4 bytes an element in float32, 1 in int8 plus a float32 scale per row.
    cfg = dense.hf_config
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    rows_cols = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]
    saved = cfg.num_hidden_layers * sum(r * c * 3 - r * 4 for r, c in rows_cols)
    assert dense_bytes - int8_bytes == saved
    per_block = dense.runner.bytes_per_block()
    assert per_block == int8.runner.bytes_per_block()
    assert dense.num_total_blocks == (budget - dense_bytes) // per_block
    assert int8.num_total_blocks == (budget - int8_bytes) // per_block
    assert int8.num_total_blocks - dense.num_total_blocks >= saved // per_block
    print(f"weights {dense_bytes} -> {int8_bytes} bytes; KV blocks {dense.num_total_blocks} -> {int8.num_total_blocks}")


def test_torchao_weights_count_at_their_real_size(tiny: Path) -> None:
    dense = _engine(tiny, model_impl="transformers")
    int8 = _engine(tiny, model_impl="transformers", quantization="int8")
    linear = sum(m.weight.numel() for m in dense.runner.model.hf.model.layers.modules()  # type: ignore[union-attr]
                 if isinstance(m, nn.Linear))
    saved = weight_bytes(dense.runner.model) - weight_bytes(int8.runner.model)  # type: ignore[arg-type]
    assert 2.9 * linear <= saved <= 3 * linear  # 4 bytes -> 1, less the scales


# ---- choices and refusals -------------------------------------------------------------------------
def _config(tiny: Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny)


def test_the_path_follows_the_quantization(tiny: Path) -> None:
    cfg = _config(tiny)
    assert pick_impl(cfg, "int8", "auto") == "native"
    assert pick_impl(cfg, "w8a8", "auto") == "transformers"  # torchao's W8A8 runs through transformers
    with pytest.raises(UnsupportedModelError, match="w8a8 runs on the transformers path only"):
        pick_impl(cfg, "w8a8", "native")
    assert plan_quantization(cfg, "auto", "native", torch.device("cpu")).name == "none"


def test_int4_on_cpu_is_refused_in_one_line(tiny: Path) -> None:
    with pytest.raises(ValueError, match="int4 needs CUDA") as e:
        plan_quantization(_config(tiny), "int4", "transformers", torch.device("cpu"))
    assert "\n" not in str(e.value)


def test_a_quantized_checkpoint_refuses_another_quantization(tiny: Path) -> None:
    cfg = _config(tiny)
    cfg.quantization_config = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 128}}}}
    with pytest.raises(ValueError, match=r"already quantized \(compressed-tensors:int4-group\)"):
        plan_quantization(cfg, "int8", "transformers", torch.device("cpu"))
    assert pick_impl(cfg, "auto", "auto") == "transformers"  # W4A16: no native kernel
    with pytest.raises(ValueError, match="quantization must be one of"):
        plan_quantization(_config(tiny), "int3", "native", torch.device("cpu"))
