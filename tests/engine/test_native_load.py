"""engine/models/native_load.py: the native model read straight from safetensors holds exactly the weights the
old path (transformers' model, then copied) gives, in float32 and bfloat16, sharded or not; a checkpoint it
does not cover falls back to transformers; and engine/loader.py's plain Llama config reads as AutoConfig does.
Greedy output against transformers' generate on the fast path: tests/engine/test_engine_correctness.py (every
native config there loads this way) and the test below."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_greedy_matches, fresh_seed, hf_greedy, make_tiny_model, random_prompts
from safetensors.torch import load_file, save_file
from sluice.engine.llm import LLM
from sluice.engine.loader import _plain_config, load_config
from sluice.engine.models.native_load import load_native
from sluice.engine.models.select import build_model
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-tied": dict(num_hidden_layers=2, tie_word_embeddings=True),
    "llama-bias": dict(num_hidden_layers=2, hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                       attention_bias=True, mlp_bias=True),
    "qwen2": dict(model_type="qwen2", num_hidden_layers=2),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, head_dim=32),
    "llama3-rope": dict(num_hidden_layers=1, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param) / "m", seed=3, **CONFIGS[request.param])


def _old_path(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return build_model(hf, "native", 256, torch.device("cpu"), dtype)  # type: ignore[return-value]


def _assert_same_weights(ours: torch.nn.Module, ref: torch.nn.Module) -> None:
    mine, theirs = dict(ours.named_parameters()), dict(ref.named_parameters())
    assert sorted(mine) == sorted(theirs)
    for name, p in theirs.items():
        assert mine[name].dtype == p.dtype, name
        assert torch.equal(mine[name], p), name
    cos, ref_cos = ours.get_buffer("rotary.cos"), ref.get_buffer("rotary.cos")
    assert torch.equal(cos, ref_cos) and cos.dtype == torch.float32
    tied = ref.lm_head.weight is ref.embed_tokens.weight  # type: ignore[union-attr]
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tied  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_load_holds_the_old_paths_weights(tiny: Path, dtype: torch.dtype) -> None:
    net = load_native(str(tiny), load_config(str(tiny)), 256, torch.device("cpu"), dtype)
    assert net is not None
    _assert_same_weights(net, _old_path(tiny, dtype))


def test_native_load_reads_a_sharded_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", seed=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").exists()
    net = load_native(str(sharded), load_config(str(sharded)), 256, torch.device("cpu"), torch.float32)
    assert net is not None
    _assert_same_weights(net, _old_path(path, torch.float32))


def _rewrite_weights(path: Path, change: Any) -> None:
    file = path / "model.safetensors"
    state = load_file(file)
    change(state)
    save_file(state, file, metadata={"format": "pt"})


@pytest.mark.parametrize("problem", ["unknown name", "missing weight", "wrong shape"])
def test_a_checkpoint_the_fast_path_does_not_cover_loads_through_transformers(
        tmp_path: Path, problem: str, caplog: pytest.LogCaptureFixture) -> None:
    path = make_tiny_model(tmp_path / "m", seed=5)
    if problem == "unknown name":
        _rewrite_weights(path, lambda s: s.__setitem__("model.layers.0.self_attn.extra.weight", torch.ones(2)))
    elif problem == "missing weight":
        _rewrite_weights(path, lambda s: s.pop("model.layers.1.self_attn.k_proj.weight"))
    else:
        _rewrite_weights(path, lambda s: s.__setitem__("model.norm.weight", torch.ones(3)))
    with caplog.at_level(logging.WARNING, logger="sluice.engine.models.native_load"):
        assert load_native(str(path), load_config(str(path)), 256, torch.device("cpu"), torch.float32) is None
    assert "loading through transformers" in caplog.text


def test_a_bin_checkpoint_loads_through_transformers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = make_tiny_model(tmp_path / "m", seed=6)
    state = load_file(path / "model.safetensors")
    torch.save(state, path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    assert "from transformers' model" in caplog.text
    out = llm.generate([Request("r", prompt_token_ids=[5, 6, 7], params=SamplingParams(max_tokens=4))])
    assert out[0].error is None and len(out[0].token_ids) == 4


def test_the_engine_loads_natively_and_matches_transformers(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = make_tiny_model(tmp_path / "m", seed=7)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(fresh_seed())
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=16 << 20)
    assert "(loaded natively)" in caplog.text
    prompts = random_prompts(rng, 4, 1, 40)
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=12)) for i, p in enumerate(prompts)]
    for p, c in zip(prompts, llm.generate(reqs), strict=True):
        assert c.error is None
        assert_greedy_matches(hf, p, c.token_ids, hf_greedy(hf, p, 12))


def test_plain_config_reads_as_autoconfig(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", seed=8, tie_word_embeddings=True)
    plain, auto = _plain_config(path), AutoConfig.from_pretrained(path)
    assert plain is not None and type(plain) is not type(auto)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_parameters", "eos_token_id",
                "bos_token_id", "is_encoder_decoder", "name_or_path"):
        assert getattr(plain, key) == getattr(auto, key), key
    assert getattr(plain, "sliding_window", None) == getattr(auto, "sliding_window", None)
    # The tokenizer given the plain config is the one AutoTokenizer finds by itself.
    text = "Hello there, tokenizer: 12345 éà"
    assert (AutoTokenizer.from_pretrained(path, config=plain)(text)["input_ids"]
            == AutoTokenizer.from_pretrained(path)(text)["input_ids"])


@pytest.mark.parametrize("change", ["drop mlp_bias", "llama3 rope", "qwen2", "quantized"])
def test_an_incomplete_or_other_config_goes_through_autoconfig(tmp_path: Path, change: str) -> None:
    path = make_tiny_model(tmp_path / "m", seed=9)
    raw = json.loads((path / "config.json").read_text())
    if change == "drop mlp_bias":
        del raw["mlp_bias"]
    elif change == "llama3 rope":
        raw["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    elif change == "qwen2":
        raw["model_type"] = "qwen2"
    else:
        raw["quantization_config"] = {"quant_method": "compressed-tensors"}
    (path / "config.json").write_text(json.dumps(raw))
    assert _plain_config(path) is None


def test_a_corrupt_config_json_is_not_read_as_plain(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", seed=10)
    shutil.copy(path / "config.json", tmp_path / "good.json")
    (path / "config.json").write_text((tmp_path / "good.json").read_text()[:-20])
    assert _plain_config(path) is None
