"""Where an adapter's deltas land: the base model's linear layers, on either model path.

A LoRA target is named as in transformers (``model.layers.3.self_attn.q_proj``). On the native path
q/k/v and gate/up are fused, so a target is a column slice of a fused layer's output; on the
transformers path it is a whole ``nn.Linear``. A forward hook on the layer (whatever runs its GEMM:
``nn.Linear``, a packed or quantized replacement) adds each row group's delta to its output in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.lora.adapters import LoraAdapter, Target


@dataclass(frozen=True)
class Site:
    """Where a target's output lies: a module (path from the model's root) and its output columns."""

    module: str
    offset: int
    width: int


@dataclass
class RowGroup:
    """One adapter's rows of the step's packed tokens: a slice when contiguous, else an index tensor."""

    adapter: LoraAdapter
    rows: slice | torch.Tensor


@dataclass
class FusedWeights:
    """One adapter's targets within one layer's output: A stacked ``[R, in]``, B block-diagonal
    ``[hi - lo, R]`` over output columns ``lo:hi``, and each rank column's scale ``[R]``."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor
    lo: int
    hi: int


@dataclass
class KernelStep:
    """The step as the Triton kernel reads it: each packed row's slot (its group's index; -1: the base)."""

    key: tuple[str, ...]  # the groups' adapters, in slot order
    slots: torch.Tensor  # [T] int32


@dataclass
class LoraHook:
    """The forward hook of one module: adds the deltas of every target that lives in its output."""

    parts: list[tuple[str, int, int]] = field(default_factory=list)  # (target, offset, width)
    groups: list[RowGroup] = field(default_factory=list)  # this step's; set by the manager
    kernel: KernelStep | None = None  # set: one Triton launch per target instead of a matmul pair per group
    # Per target: the groups' weights stacked for the kernel, and the adapters they were stacked for.
    stacks: dict[str, tuple[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]] = field(
        default_factory=dict)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        if not self.groups:
            return
        x = args[0].reshape(-1, args[0].shape[-1])
        out = output.view(-1, output.shape[-1])
        if self.kernel is not None:
            self._launch(x, out, self.kernel)
            return
        for group in self.groups:
            f = self._fused(group.adapter)
            if f is None:
                continue
            # peft's B(A(x)) * scale, for every target of this layer at once: the targets' A stacked,
            # each one's scale on its own rank's columns, and B block-diagonal over their output columns.
            t = F.linear(x[group.rows], f.a) * f.scale
            out[group.rows, f.lo : f.hi] += F.linear(t, f.b)

    def _fused(self, adapter: LoraAdapter) -> FusedWeights | None:
        """``adapter``'s targets in this layer as one shrink and one expand (made once per adapter)."""
        key = id(self)
        if key in adapter.fused:
            return adapter.fused[key]
        parts = [(adapter.modules[t], off, width) for t, off, width in self.parts if t in adapter.modules]
        fused = None
        if parts:
            like = parts[0][0].a
            lo, hi = min(off for _, off, _ in parts), max(off + width for _, off, width in parts)
            ranks = [w.a.shape[0] for w, _, _ in parts]
            b = like.new_zeros(hi - lo, sum(ranks))
            col = 0
            for (w, off, width), r in zip(parts, ranks, strict=True):
                b[off - lo : off - lo + width, col : col + r] = w.b
                col += r
            scale = torch.cat([like.new_full((r,), w.scale) for (w, _, _), r in zip(parts, ranks, strict=True)])
            fused = FusedWeights(torch.cat([w.a for w, _, _ in parts]), b, scale, lo, hi)
        adapter.fused[key] = fused
        return fused

    def _launch(self, x: torch.Tensor, out: torch.Tensor, step: KernelStep) -> None:
        from kernels.lora import lora_delta_

        for target, offset, width in self.parts:
            stack = self._stack(target, step.key)
            if stack is not None:
                lora_delta_(out[:, offset : offset + width], x, step.slots, *stack)

    def _stack(self, target: str, key: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The groups' A and B for ``target`` as ``[L, R, K]`` and ``[L, N, R]`` (lower ranks zero-padded,
        a group whose adapter skips the target all zeros) and their scales; None if none targets it.
        Rebuilt only when the step's adapters change."""
        cached = self.stacks.get(target)
        if cached is not None and cached[0] == key:
            return cached[1]
        weights = [g.adapter.modules.get(target) for g in self.groups]
        present = [w for w in weights if w is not None]
        stack = None
        if present:
            r, (n, k) = max(w.a.shape[0] for w in present), (present[0].b.shape[0], present[0].a.shape[1])
            like = present[0].a
            a = like.new_zeros(len(weights), r, k)
            b = like.new_zeros(len(weights), n, r)
            scale = torch.zeros(len(weights), dtype=torch.float32, device=like.device)
            for slot, w in enumerate(weights):
                if w is not None:
                    a[slot, : w.a.shape[0]] = w.a
                    b[slot, :, : w.a.shape[0]] = w.b
                    scale[slot] = w.scale
            stack = (a, b, scale)
        self.stacks[target] = (key, stack)
        return stack


def native_targets(net: Any) -> dict[str, tuple[Target, Site]]:
    """The Llama-family native model's q/k/v/o/gate/up/down of every layer, in transformers' naming."""
    cfg = net.config
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    out: dict[str, tuple[Target, Site]] = {}
    for i, layer in enumerate(net.layers):
        attn = layer.self_attn
        q, kv = attn.q_size, attn.kv_size
        a, m = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        out[f"model.{a}.q_proj"] = Target(hidden, q), Site(f"{a}.qkv_proj", 0, q)
        out[f"model.{a}.k_proj"] = Target(hidden, kv), Site(f"{a}.qkv_proj", q, kv)
        out[f"model.{a}.v_proj"] = Target(hidden, kv), Site(f"{a}.qkv_proj", q + kv, kv)
        out[f"model.{a}.o_proj"] = Target(q, hidden), Site(f"{a}.o_proj", 0, hidden)
        out[f"model.{m}.gate_proj"] = Target(hidden, inter), Site(f"{m}.gate_up_proj", 0, inter)
        out[f"model.{m}.up_proj"] = Target(hidden, inter), Site(f"{m}.gate_up_proj", inter, inter)
        out[f"model.{m}.down_proj"] = Target(inter, hidden), Site(f"{m}.down_proj", 0, hidden)
    return out


def transformers_targets(net: Any) -> dict[str, tuple[Target, Site]]:
    """Every ``nn.Linear`` of the wrapped transformers model but its head (the logits are computed
    apart, for the sampled rows only)."""
    hf, head = net.hf, net.lm_head
    out: dict[str, tuple[Target, Site]] = {}
    for name, module in hf.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            out[name] = Target(module.in_features, module.out_features), Site(f"hf.{name}", 0, module.out_features)
    return out
