"""What ``--quantization`` means for a model, and which path runs it.

- ``auto``: a checkpoint's own quantization (its config's ``quantization_config``), else dense weights.
  transformers' quantizer integrations load it. compressed-tensors int8 checkpoints with per-channel
  weight-only scales run on the native path as int8 (engine/quant/int8.py; the checkpoint's own int8
  values: transformers reads it back dequantized and the checkpoint's scales divide them out again,
  engine/quant/checkpoint.py). Every other quantized checkpoint runs
  on the transformers path; on CPU, compressed-tensors' own route decompresses the weights to dense at
  the first forward (transformers has FP8 kernels for CUDA >= 8.9 only), so its memory is not saved there.
- ``int8``: int8 weight-only, one scale per output channel, quantized at load: the native path's
  Int8Linear, or torchao's ``Int8WeightOnlyConfig`` through transformers' ``TorchAoConfig``.
- ``w8a8``: torchao's int8 weights with int8 dynamic per-token activations (transformers path).
- ``int4``: torchao int4 weight-only, group size 128 (transformers path, CUDA only: torchao 0.18 has no
  int4 layout with a CPU kernel).

GPTQ/AWQ checkpoints load through transformers where its backend (gptqmodel) is installed; Sluice does
not install or test it. A GGUF file is dequantized to dense (engine/loader.py), whatever its quant type;
``--quantization int8`` then requantizes the dense weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sluice.engine.config import QUANTIZATIONS
from sluice.engine.models.base import UnsupportedModelError
from sluice.engine.models.select import pick_model_impl

_TRANSFORMERS_ONLY = ("w8a8", "int4")


@dataclass(frozen=True)
class QuantPlan:
    name: str  # the start-up line's and /v1/models' word for it: none | int8 | w8a8 | int4 | compressed-tensors:...
    load_config: Any = None  # transformers' quantization_config for from_pretrained; None: the checkpoint's own
    native_int8: bool = False  # the native path swaps its linear layers for Int8Linear after loading
    checkpoint_scales: bool = False  # ... with the checkpoint's own scales (engine/quant/checkpoint.py)


def checkpoint_quantization(config: Any) -> dict[str, Any] | None:
    """The checkpoint's ``quantization_config`` as a dict, or None for dense weights."""
    q = getattr(config, "quantization_config", None)
    if q is None:
        return None
    return dict(q) if isinstance(q, dict) else q.to_dict()


def describe_checkpoint(q: dict[str, Any]) -> str:
    """``method`` plus, for compressed-tensors, each group's weight type, e.g. ``compressed-tensors:int8-channel``."""
    method = str(q.get("quant_method", "unknown"))
    if method != "compressed-tensors":
        bits = q.get("bits") or q.get("w_bit")
        return f"{method}:int{bits}" if bits else method
    parts = []
    for group in (q.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        act = "" if not group.get("input_activations") else "-a" + str(group["input_activations"].get("num_bits"))
        parts.append(f"{w.get('type')}{w.get('num_bits')}-{w.get('strategy')}{act}")
    return f"{method}:{','.join(sorted(set(parts)))}"


def native_int8_checkpoint(q: dict[str, Any]) -> bool:
    """compressed-tensors with symmetric int8 weights, one scale per output channel, activations not
    quantized: exactly what Int8Linear holds."""
    if q.get("quant_method") != "compressed-tensors":
        return False
    groups = list((q.get("config_groups") or {}).values())
    return bool(groups) and all(
        (g.get("weights") or {}).get("type") == "int" and g["weights"].get("num_bits") == 8
        and g["weights"].get("strategy") == "channel" and g["weights"].get("symmetric", True)
        and not g.get("input_activations")
        for g in groups)


def _native_can_run(config: Any, requested: str) -> str | None:
    """Why the native path cannot run this quantization (None: it can)."""
    q = checkpoint_quantization(config)
    if q is not None:
        if native_int8_checkpoint(q):
            return None
        return f"the checkpoint's quantization ({describe_checkpoint(q)}) runs on the transformers path only"
    if requested in _TRANSFORMERS_ONLY:
        return f"quantization {requested} runs on the transformers path only"
    return None


def pick_impl(config: Any, quantization: str, requested_impl: str) -> str:
    """``select.pick_model_impl``, then the transformers path where the native one cannot run the
    quantization (or a one-line refusal where native was asked for)."""
    impl = pick_model_impl(config, requested_impl)
    why = _native_can_run(config, quantization) if impl == "native" else None
    if why is None:
        return impl
    if requested_impl == "native":
        raise UnsupportedModelError(f"model_impl native: {why}; use model_impl auto or transformers")
    return "transformers"


def plan_quantization(config: Any, requested: str, impl: str, device: torch.device) -> QuantPlan:
    """How to load and run ``requested`` for this model on ``impl`` (from ``pick_impl``)."""
    if requested not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, not {requested!r}")
    q = checkpoint_quantization(config)
    if q is not None:
        if requested != "auto":
            raise ValueError(f"the checkpoint is already quantized ({describe_checkpoint(q)}); "
                             f"quantization {requested} applies to dense checkpoints: use auto")
        if impl == "native":  # native_int8_checkpoint: read back dense, requantized per channel
            from transformers import CompressedTensorsConfig

            return QuantPlan(describe_checkpoint(q), CompressedTensorsConfig(dequantize=True), native_int8=True,
                             checkpoint_scales=True)
        return QuantPlan(describe_checkpoint(q))
    if requested == "auto":
        return QuantPlan("none")
    if requested == "int4" and device.type != "cuda":
        raise ValueError("quantization int4 needs CUDA: torchao has no int4 weight layout with a CPU kernel "
                         "(use int8 on CPU)")
    if impl == "native":
        return QuantPlan("int8", native_int8=True)
    return QuantPlan(requested, _torchao_config(requested))


def _torchao_config(requested: str) -> Any:
    from transformers import TorchAoConfig

    try:
        from torchao.quantization import (
            Int4WeightOnlyConfig,
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
        )
    except ImportError:
        raise ValueError(f"quantization {requested} on the transformers path needs torchao: "
                         "pip install 'sluice-llm[quant]'") from None
    kinds = {"int8": Int8WeightOnlyConfig, "w8a8": Int8DynamicActivationInt8WeightConfig,
             "int4": lambda: Int4WeightOnlyConfig(group_size=128)}
    return TorchAoConfig(kinds[requested]())
