"""Which implementation runs a model: the native fast path where one exists, else transformers' own modules."""

from __future__ import annotations

from typing import Any

import torch
from sluice.engine.models import llama
from sluice.engine.models.base import CausalLM, UnsupportedModelError

MODEL_IMPLS = ("auto", "native", "transformers")
# Decoder-only architectures the test suite checks token for token against transformers' generate.
TESTED_TRANSFORMERS = ("llama", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "olmo2", "mixtral", "qwen2_moe",
                       "qwen3_moe", "granite", "stablelm", "gpt_neox")
# Vision-language models (engine/vision.py) checked the same way, with images (tests/engine/test_vision.py; M-RoPE:
# tests/engine/test_vision_qwen2vl.py).
TESTED_VISION = ("llava", "idefics3", "qwen2_vl", "qwen2_5_vl")


def pick_model_impl(config: Any, requested: str) -> str:
    """``auto``: native where it exists, else transformers."""
    if requested not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, not {requested!r}")
    native = config.model_type in llama.SUPPORTED
    if requested == "native" and not native:
        raise UnsupportedModelError(f"no native implementation of {config.model_type!r} (native: "
                                    f"{', '.join(llama.SUPPORTED)}); use model_impl auto or transformers")
    if requested == "auto":
        return "native" if native else "transformers"
    return requested


def build_model(hf: Any, impl: str, max_positions: int, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The model for ``impl`` on ``device``, from transformers' loaded model ``hf`` (whose weights it takes)."""
    if impl == "native":
        net = llama.build_model(hf.config, max_positions, device, dtype)
        net.load_hf_state_dict(hf.state_dict())
        return net.eval()
    from sluice.engine.models.transformers_model import build_transformers_model

    return build_transformers_model(hf, device, dtype)
