"""Where an adapter's deltas land: the base model's linear layers, on either model path.

A LoRA target is named as in transformers (``model.layers.3.self_attn.q_proj``). On the native path
q/k/v and gate/up are fused, so a target is a column slice of a fused layer's output; on the
transformers path it is a whole ``nn.Linear``. A forward hook on the layer (whatever runs its GEMM:
``nn.Linear``, a packed or quantized replacement) adds each row group's delta to its output in place.

On CPU the hook gathers the step's adapter rows once, grouped by adapter (``LoraStep``, built once per
step), runs one shrink and one expand per group on contiguous slices of that copy, and adds the deltas
back with one ``index_add_``: per-group gathers and indexed ``+=`` cost more than the small GEMMs
themselves (measured: about 0.36x of a layer's base GEMMs at 4 adapters, against 0.16x this way).
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
class FusedWeights:
    """One adapter's targets within one layer's output: A stacked ``[R, in]`` with each target's scale
    folded in, and B block-diagonal ``[hi - lo, R]`` over output columns ``lo:hi``."""

    a: torch.Tensor
    b: torch.Tensor
    lo: int
    hi: int


@dataclass
class KernelStep:
    """The step as the Triton kernel reads it: each packed row's slot (its group's index; -1: the base)."""

    key: tuple[str, ...]  # the groups' adapters, in slot order
    slots: torch.Tensor  # [T] int32


@dataclass
class LoraStep:
    """The step's rows that take an adapter, as every hook reads them (built once per step). ``rows``
    lists them grouped by adapter, in ``groups`` order: a slice where they already lie so in the packed
    batch, else the index that gathers them. Group ``i`` is ``adapters[i]`` on ``bounds[i]:bounds[i+1]``
    of that order."""

    rows: slice | torch.Tensor
    adapters: list[LoraAdapter]
    bounds: list[int]
    kernel: KernelStep | None = None  # set: one Triton launch per target instead of a matmul pair per group


@dataclass
class LoraHook:
    """The forward hook of one module: adds the deltas of every target that lives in its output."""

    parts: list[tuple[str, int, int]] = field(default_factory=list)  # (target, offset, width)
    step: LoraStep | None = None  # this step's adapter rows (None: no row takes an adapter); set by the manager
    # Per target: the groups' weights stacked for the kernel, and the adapters they were stacked for.
    stacks: dict[str, tuple[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]] = field(
        default_factory=dict)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        step = self.step
        if step is None:
            return
        x = args[0].reshape(-1, args[0].shape[-1])
        out = output.view(-1, output.shape[-1])
        if step.kernel is not None:
            self._launch(x, out, step)
            return
        fused = [self._fused(a) for a in step.adapters]
        present = [f for f in fused if f is not None]
        if not present:
            return
        lo, hi = min(f.lo for f in present), max(f.hi for f in present)
        xs = x[step.rows] if isinstance(step.rows, slice) else x.index_select(0, step.rows)
        # Every group's delta over columns lo:hi; left uninitialised only where every group writes all of it.
        whole = len(present) == len(fused) and all(f.lo == lo and f.hi == hi for f in present)
        delta = (xs.new_empty if whole else xs.new_zeros)(xs.shape[0], hi - lo)
        for f, start, end in zip(fused, step.bounds, step.bounds[1:], strict=False):
            if f is not None:
                # peft's B(A(x)) * scale, for every target of this layer at once: the targets' A stacked
                # (each scaled), and B block-diagonal over their output columns.
                torch.mm(F.linear(xs[start:end], f.a), f.b.t(), out=delta[start:end, f.lo - lo : f.hi - lo])
        if isinstance(step.rows, slice):
            out[step.rows, lo:hi] += delta
        else:
            out[:, lo:hi].index_add_(0, step.rows, delta)

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
            fused = FusedWeights(torch.cat([w.a * w.scale for w, _, _ in parts]), b, lo, hi)
        adapter.fused[key] = fused
        return fused

    def _launch(self, x: torch.Tensor, out: torch.Tensor, step: LoraStep) -> None:
        from kernels.lora import lora_delta_

        assert step.kernel is not None
        for target, offset, width in self.parts:
            stack = self._stack(target, step.kernel.key, step.adapters)
            if stack is not None:
                lora_delta_(out[:, offset : offset + width], x, step.kernel.slots, *stack)

    def _stack(self, target: str, key: tuple[str, ...],
               adapters: list[LoraAdapter]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The groups' A and B for ``target`` as ``[L, R, K]`` and ``[L, N, R]`` (lower ranks zero-padded,
        a group whose adapter skips the target all zeros) and their scales; None if none targets it.
        Rebuilt only when the step's adapters change."""
        cached = self.stacks.get(target)
        if cached is not None and cached[0] == key:
            return cached[1]
        weights = [a.modules.get(target) for a in adapters]
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
