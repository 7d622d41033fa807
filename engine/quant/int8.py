"""int8 weight-only linear layers for the native path: one symmetric scale per output channel.

The weight is held as int8 (a quarter of float32's bytes, half of bfloat16's) plus a scale per row; the
input stays in the model's dtype. Two GEMMs, chosen per call by row count (bench/quant_throughput.py
--gemm times both here):
- ``torch._weight_int8pack_mm`` (ATen's CPU kernel: int8 weight, bfloat16/float16 input, scaled rows):
  fastest at decode-sized row counts in bfloat16, but its float32 kernel and its large-row kernel are slow;
- dequantize on the fly: ``F.linear(x, q.to(x.dtype)) * scale``: one dense GEMM on a transient copy of the
  weight, which costs O(weight) per call and so pays off once the rows are many.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Up to this many rows, bfloat16/float16 inputs take _weight_int8pack_mm (measured here, on the default
# model's shapes: 3x faster than the dense bfloat16 GEMM at 1 row, even at 16 rows, 2x slower at 128).
INT8PACK_MAX_ROWS = 16
QMAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``weight ~ q * scale[:, None]`` with ``scale = absmax / 127``, so a
    weight that is already int8-per-channel (q * s, some |q| = 127) comes back as the same q exactly."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale, q = 0
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """``y = x @ (q * scale)^T + bias`` with ``q`` int8 ``[out, in]`` and ``scale`` ``[out]``."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.qweight: torch.Tensor
        self.scale: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.to(dtype))  # ATen's kernel wants the input's dtype
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        q, scale = quantize_per_channel(linear.weight)
        return cls(q, scale, linear.bias, linear.weight.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, in its dtype (the tests' reference)."""
        return (self.qweight.float() * self.scale.float()[:, None]).to(self.scale.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and rows <= INT8PACK_MAX_ROWS:
            y = torch._weight_int8pack_mm(x.reshape(rows, self.in_features), self.qweight, self.scale)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def quantize_with_scale(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight``'s int8 values for given per-row scales: a checkpoint's own, under which its dequantized
    weight (q * scale, rounded once) divides back to exactly q (its quantizer may use all of -128..127)."""
    return torch.round(weight.detach().float() / scale.float()[:, None]).clamp_(-128, 127).to(torch.int8)


# The native path's fused layers and the checkpoint layers stacked in them, in order, along the output rows.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_scale(name: str, scales: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-row scale of the native layer ``name`` (``layers.0.self_attn.qkv_proj``) from a checkpoint's
    ``weight_scale`` tensors (``model.layers.0.self_attn.q_proj.weight_scale``, ...)."""
    prefix, _, last = name.rpartition(".")
    parts = [f"model.{prefix}.{p}.weight_scale" for p in FUSED.get(last, (last,))]
    missing = [p for p in parts if p not in scales]
    if missing:
        raise ValueError(f"the checkpoint has no {missing[0]} (not an int8 per-channel layer)")
    return torch.cat([scales[p].flatten() for p in parts])


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",),
                     scales: dict[str, torch.Tensor] | None = None) -> int:
    """Replace every plain ``nn.Linear`` of ``model`` (but those named in ``skip``: the head stays in the
    model's dtype, as transformers' torchao and most int8 checkpoints leave it) by an ``Int8Linear``;
    returns how many. ``scales``: a checkpoint's ``weight_scale`` tensors by name, to take its int8
    values back exactly; None: absmax / 127 per row."""
    count = 0
    for full, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or name in skip:
                continue
            if scales is None:
                layer = Int8Linear.from_linear(child)
            else:
                scale = checkpoint_scale(f"{full}.{name}" if full else name, scales)
                layer = Int8Linear(quantize_with_scale(child.weight, scale), scale, child.bias, child.weight.dtype)
            setattr(parent, name, layer)
            count += 1
    return count
