"""An embedding model's CPU linear layers: weights reordered once for oneDNN (engine/linear.py's
PackedLinear: no per-call bias copy, a blocked weight layout), and an encoder's linear -> GELU pair
(BERT, RoBERTa, XLM-R, MPNet name it ``intermediate.dense`` / ``intermediate_act_fn``; CLIP- and
SigLIP-style vision towers ``mlp.fc1`` / ``activation_fn``) as one oneDNN call with the GELU fused into
the GEMM's output, so the widest activation is written once, not three times. A vision-language model's
tower gets the same fusion (``fuse_vision_gelu``): in transformers' own layers aten's tanh GELU took a
quarter of SmolVLM-256M's tower time (bfloat16, 2-core Xeon with AMX); fused, 8 captioning lines took 11.4 s
instead of 12.0 (one run each). Measured on all-MiniLM-L6-v2's FFN shapes at 2,048-8,192 rows, the packed
GEMMs took roughly half of aten's time (a loaded 2-core machine: indicative only).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from sluice.engine.linear import PackedLinear, install, onednn_supports
from torch import nn

log = logging.getLogger(__name__)

CPU_LINEAR = ("auto", "aten", "onednn-packed")


class PackedDenseGelu(nn.Module):
    """``gelu(dense(x))`` in one oneDNN call on a packed weight: exact (erf) GELU, or (``approximate="tanh"``)
    its tanh approximation."""

    def __init__(self, dense: nn.Linear, approximate: str = "none") -> None:
        super().__init__()
        self.gemm = PackedLinear(dense.weight, dense.bias)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.gemm.packed, self.gemm.bias, "gelu", [], self.approximate)


def gelu_approximation(act: object) -> str | None:
    """oneDNN's GELU algorithm for transformers' activation ``act``: ``none`` (its "gelu": F.gelu, erf) or ``tanh``
    ("gelu_pytorch_tanh": F.gelu's tanh approximation); None for the others ("gelu_new" and the python variants
    compute in other steps, "quick_gelu" is another function): those stay unfused."""
    fn = getattr(act, "act", None)
    if type(act).__name__ == "GELUActivation" and fn is F.gelu:
        return "none"
    if (type(act).__name__ == "GELUTanh" and isinstance(fn, functools.partial) and fn.func is F.gelu
            and fn.keywords == {"approximate": "tanh"}):
        return "tanh"
    return None


# (linear, activation) attributes a module applies one after the other: BERT-style encoders' intermediate
# layer, CLIP/SigLIP-style MLPs (Idefics3's and LLaVA's vision towers).
_LINEAR_THEN_ACT = (("dense", "intermediate_act_fn"), ("fc1", "activation_fn"))


def fuse_gelu(net: nn.Module) -> int:
    """Each linear -> GELU pair of ``net`` as one oneDNN call (PackedDenseGelu); returns how many."""
    fused = 0
    for module in list(net.modules()):
        for linear, act in _LINEAR_THEN_ACT:
            dense, approximate = getattr(module, linear, None), gelu_approximation(getattr(module, act, None))
            if type(dense) is nn.Linear and approximate is not None:
                setattr(module, linear, PackedDenseGelu(dense, approximate))
                setattr(module, act, nn.Identity())
                fused += 1
    return fused


def fuse_vision_gelu(net: nn.Module, requested: str, device: torch.device, dtype: torch.dtype) -> int:
    """A vision-language model's tower: its MLPs' linear -> GELU fused (the decoder has none of these pairs),
    before use_cpu_linear packs the other linear layers; nothing where oneDNN does not run or ``aten`` was asked."""
    if requested == "aten" or device.type != "cpu" or not onednn_supports(dtype):
        return 0
    fused = fuse_gelu(net)
    log.info("vision tower: %d linear -> GELU pairs fused (oneDNN)", fused)
    return fused


def use_encoder_cpu_linear(net: nn.Module, requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Install the linear implementation for a loaded embedding model; returns which."""
    if requested not in CPU_LINEAR:
        raise ValueError(f"cpu_linear must be one of {CPU_LINEAR}, not {requested!r}")
    usable = device.type == "cpu" and onednn_supports(dtype)
    if requested == "aten" or (requested == "auto" and not usable):
        return "aten"
    if not usable:
        raise ValueError(f"cpu_linear onednn-packed needs the CPU and a dtype oneDNN runs here, not {device} {dtype}")
    fused = fuse_gelu(net)
    packed = install(net, "onednn-packed")
    log.info("linear layers: onednn-packed (%d packed, %d with GELU fused)", packed + fused, fused)
    return "onednn-packed"
