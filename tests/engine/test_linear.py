"""CPU linear implementations (engine/linear.py): each against a float64 reference, the measured choice,
and their installation into a loaded model."""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

import pytest
import torch
from helpers import assert_greedy_matches, fresh_seed, hf_greedy, make_tiny_model, random_prompts
from sluice.engine import linear
from sluice.engine.config import EngineConfig
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

TINY = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=2, vocab_size=1000)
CASES = [(impl, dtype) for dtype in (torch.float32, torch.bfloat16) for impl in linear.candidates(dtype)]


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 values at ``x`` (8 significand bits), for float64 ``x``."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)))
    return torch.exp2(exponent - 7)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize(("impl", "dtype"), CASES, ids=[f"{i}-{str(d)[6:]}" for i, d in CASES])
def test_each_implementation_matches_a_float64_product(impl: str, dtype: torch.dtype, bias: bool) -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    k, n = 77, 131
    dense = nn.Linear(k, n, bias=bias, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(n, k, generator=gen))
        if bias:
            dense.bias.copy_(torch.randn(n, generator=gen))
    layer = linear.make_linear(impl, dense)
    assert (layer is dense) == (impl == "aten")
    w, b = dense.weight.double(), dense.bias.double() if bias else torch.zeros(n, dtype=torch.float64)
    for m in (1, 3, 17, 128):
        x = torch.randn(m, k, generator=gen).to(dtype)
        with torch.inference_mode():
            y = layer(x)
        assert y.shape == (m, n) and y.dtype == dtype
        exact = x.double() @ w.T + b
        # Any summation order in float32 is within k float32 roundings of the magnitudes summed.
        accumulation = k * 2.0**-24 * (x.double().abs() @ w.abs().T + b.abs())
        if dtype == torch.float32:
            bound = accumulation
        else:  # one bfloat16 ulp of the exact product rounded to bfloat16, as a bf16 GEMM promises
            bound = _bf16_ulp(exact.to(dtype).double()) + accumulation
        err = (y.double() - exact).abs()
        assert bool((err <= bound).all()), (f"seed={seed} m={m}: worst error {float(err.max()):.3g} "
                                            f"exceeds its bound by {float((err - bound).max()):.3g}")


def test_the_choice_is_the_fastest_measured_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        impl, why = linear.pick_cpu_linear("auto", TINY, torch.device("cpu"), dtype)
        assert impl in linear.candidates(dtype)
        ms = dict(re.findall(r"([\w-]+) ([\d.]+)", why.split("ms:")[1]))
        assert sorted(ms) == sorted(linear.candidates(dtype)), why
        # The log rounds to a microsecond, so compare as it prints: two ways may tie there.
        low = min(float(v) for v in ms.values())
        assert impl == "aten" or float(ms[impl]) == low, why
        if impl == "aten":  # kept unless another way beat it by the margin
            assert low * linear.MARGIN + 0.002 >= float(ms["aten"]), why
    net = nn.Sequential(nn.Linear(8, 8))
    with caplog.at_level(logging.INFO, logger="sluice.engine.linear"):
        impl = linear.use_cpu_linear(net, "auto", TINY, torch.device("cpu"), torch.float32)
    assert f"linear layers: {impl}" in caplog.text and "batch 128" in caplog.text


def test_forced_choices_are_checked() -> None:
    cpu = torch.device("cpu")
    assert linear.pick_cpu_linear("aten", TINY, cpu, torch.bfloat16) == ("aten", "forced by cpu_linear")
    assert linear.pick_cpu_linear("fp32-compute", TINY, torch.device("cuda"), torch.bfloat16)[0] == "aten"
    with pytest.raises(ValueError, match="cannot run a float32 model"):
        linear.pick_cpu_linear("fp32-compute", TINY, cpu, torch.float32)
    with pytest.raises(ValueError, match="cpu_linear must be one of"):
        EngineConfig(cpu_linear="mkl")


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tied") / "m", seed=3, num_hidden_layers=1, tie_word_embeddings=True)


@pytest.mark.parametrize("impl", ["aten", *linear.candidates(torch.bfloat16)[1:]])
def test_install_replaces_every_linear_and_the_embedding_keeps_its_weight(tied: Path, impl: str) -> None:
    dtype = "float32" if impl == "onednn-packed" else "bfloat16"
    llm = LLM(str(tied), dtype=dtype, cpu_linear=impl, kv_cache_memory=8 << 20)
    net = llm.runner.model
    assert llm.cpu_linear == impl
    assert any(type(m) is nn.Linear for m in net.modules()) == (impl == "aten")
    assert isinstance(net.embed_tokens.weight, nn.Parameter)
    assert net.embed_tokens.weight.dtype == llm.dtype
    ids = torch.tensor([5, 6, 7])
    with torch.inference_mode():  # the head's copy computes the same logits as the embedding's weight
        hidden = net.embed_tokens(ids)
        exact = hidden.double() @ net.embed_tokens.weight.double().T
        logits = net.compute_logits(hidden)
    tol = 1e-4 if llm.dtype == torch.float32 else 2e-2 * float(exact.abs().max())
    torch.testing.assert_close(logits.double(), exact, rtol=0, atol=tol)


def test_the_transformers_path_runs_packed_and_matches_generate(tmp_path: Path) -> None:
    """transformers' own modules with every nn.Linear replaced (the wrapper's lm_head is also hf.lm_head)."""
    path = make_tiny_model(tmp_path / "m", seed=4, num_hidden_layers=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", model_impl="transformers", cpu_linear="onednn-packed", kv_cache_memory=8 << 20)
    net = llm.runner.model
    assert not any(type(m) is nn.Linear for m in net.modules())
    assert net.lm_head is net.hf.lm_head
    prompts = random_prompts(random.Random(fresh_seed()), 3, 1, 30)
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=8)) for i, p in enumerate(prompts)]
    for p, c in zip(prompts, llm.generate(reqs), strict=True):
        assert_greedy_matches(hf, p, c.token_ids, hf_greedy(hf, p, 8))
