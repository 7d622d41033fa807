"""Where an adapter's deltas land: the base model's linear layers, on either model path.

A LoRA target is named as in transformers (``model.layers.3.self_attn.q_proj``). On the native path
q/k/v and gate/up are fused, so a target is a column slice of a fused layer's output; on the
transformers path it is a whole ``nn.Linear``. A forward hook on the layer (whatever runs its GEMM:
``nn.Linear``, a packed or quantized replacement) adds each row group's delta to its output in place.

On CPU the model runner puts the step's sequences in adapter order (engine/lora/batch.py), so each
adapter's rows are one contiguous run of the packed batch. With the C++ ops built (beside the C++ attention
op), a layer's LoRA is one call (kernels/cpu/lora.cpp) for every run and target: per block of rows one
shrink over all the layer's targets (their A side by side, scales folded in) kept in registers, and each
target's expand added straight into its columns of the output. The stacked weights are kept per hook while
the step's adapters stay the same (the order sorts adapters by name, so batch churn does not restack). As
torch calls, the same work was hundreds of tiny GEMMs a step, each paying dispatch and a thread barrier: at
4 adapters a native decode step (120 hooks) made 480 shrink + 840 expand GEMMs, and cost a quarter of the
step for ~5% of its FLOPs; one layer's q/k/v (160 rows, 4 adapters, rank 16) took 0.09-0.11 ms as one call
against 0.64-1.0 ms as torch's grouped GEMMs (loaded machine). Without the C++ ops (and for tests of the
fallback), per run: one shrink GEMM over the layer's targets into a step-long scratch buffer, then one
``addmm_`` per target straight into its columns of the output rows (a strided view: no gather, no scatter).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from sluice.engine.lora.adapters import LoraAdapter, Target
from torch import nn


@dataclass(frozen=True)
class Site:
    """Where a target's output lies: a module (path from the model's root) and its output columns."""

    module: str
    offset: int
    width: int


@dataclass
class FusedWeights:
    """One adapter's targets within one layer's output: A stacked and transposed ``[in, R]`` with each
    target's scale folded in, and per target (output column, width, its A rows r0:r1, B^T ``[r, width]``)."""

    a_t: torch.Tensor
    parts: list[tuple[int, int, int, int, torch.Tensor]]


@dataclass
class StackedWeights:
    """The step's adapters (in slot order) in one layer, as the C++ op reads them, float32: A of every target
    side by side, transposed, scales folded in, ``[G, in, R]`` (R padded to a multiple of 16, the op's
    vector width); per target B^T ``[G, rank, width]``, its first output column and first column of the
    shrink. A target's columns are the widest rank among the adapters; an adapter of lower rank, or without
    the target, has zeros there."""

    a: torch.Tensor
    b: list[torch.Tensor]
    cols: list[int]
    c0s: list[int]


@dataclass
class CpuStep:
    """The step as the C++ op reads it: its adapters (slot order; their names key each hook's stacked
    weights) and each run of packed rows as (first row, end row, slot)."""

    adapters: list[LoraAdapter]
    runs: torch.Tensor  # [n, 3] int64
    key: tuple[tuple[str, int], ...]  # the adapters' keys: what the stacked weights were made for


@dataclass
class KernelStep:
    """The step as the Triton kernel reads it: each packed row's slot (its adapter's index; -1: the base)."""

    adapters: list[LoraAdapter]  # the step's adapters, in slot order
    slots: torch.Tensor  # [T] int32


@dataclass
class LoraStep:
    """The step's rows that take an adapter, as every hook reads them (built once per step): each run of
    packed rows ``start:end`` on one adapter, and a scratch buffer the shrinks write into (hooks run one
    after another, so one serves them all)."""

    runs: list[tuple[LoraAdapter, int, int]]
    scratch: torch.Tensor  # flat, at least the longest run's rows x the largest stacked rank
    kernel: KernelStep | None = None  # set: one Triton launch per target instead of a matmul pair per group
    cpu: CpuStep | None = None  # set: one C++ op call for every run and target


@dataclass
class LoraHook:
    """The forward hook of one module: adds the deltas of every target that lives in its output."""

    parts: list[tuple[str, int, int]] = field(default_factory=list)  # (target, offset, width)
    step: LoraStep | None = None  # this step's adapter rows (None: no row takes an adapter); set by the manager
    # Per target: the groups' weights stacked for the kernel, and the adapters they were stacked for.
    stacks: dict[str, tuple[tuple[tuple[str, int], ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]] = field(
        default_factory=dict)
    # The C++ op's weights and the adapters (slot order) they were stacked for.
    stacked: tuple[tuple[tuple[str, int], ...], StackedWeights | None] = ((), None)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        step = self.step
        if step is None:
            return
        x = args[0].reshape(-1, args[0].shape[-1])
        out = output.view(-1, output.shape[-1])
        if step.kernel is not None:
            self._launch(x, out, step)
            return
        if step.cpu is not None:
            self._cpu_op(x, out, step.cpu)
            return
        for adapter, start, end in step.runs:
            f = self._fused(adapter)
            if f is None:
                continue
            # peft's B(A(x)) * scale: every target's shrink in one GEMM, each expand added in place.
            n, r = end - start, f.a_t.shape[1]
            s = torch.mm(x[start:end], f.a_t, out=step.scratch[: n * r].view(n, r))
            _expand(out[start:end], s, f)

    def _cpu_op(self, x: torch.Tensor, out: torch.Tensor, step: CpuStep) -> None:
        from sluice.kernels.cpu_ops import lora_add_

        stack = self._stacked(step)
        if stack is not None:
            lora_add_(out, x, step.runs, stack.a, stack.b, stack.cols, stack.c0s)

    def _stacked(self, step: CpuStep) -> StackedWeights | None:
        """The step's adapters' weights for this layer stacked for the C++ op, made when the step's adapters
        change; None if none of them targets this layer."""
        if self.stacked[0] == step.key:
            return self.stacked[1]
        targets = []  # (col, width, its first column of the shrink, its widest rank, each adapter's weights)
        c0 = 0
        for target, col, width in self.parts:
            weights = [a.modules.get(target) for a in step.adapters]
            rank = max((w.a.shape[0] for w in weights if w is not None), default=0)
            if rank:
                targets.append((col, width, c0, rank, weights))
                c0 += rank
        stack = None
        if targets:
            like = next(w for *_, ws in targets for w in ws if w is not None).a
            a = torch.zeros(len(step.adapters), like.shape[1], -(-c0 // 16) * 16, device=like.device)
            stack = StackedWeights(a, [], [], [])
            for col, width, t0, rank, weights in targets:
                b = torch.zeros(len(step.adapters), rank, width, device=like.device)
                for i, w in enumerate(weights):
                    if w is not None:
                        r = w.a.shape[0]
                        a[i, :, t0 : t0 + r] = (w.a.float() * w.scale).t()
                        b[i, :r] = w.b.float().t()
                stack.b.append(b)
                stack.cols.append(col)
                stack.c0s.append(t0)
        self.stacked = (step.key, stack)
        return stack

    def _fused(self, adapter: LoraAdapter) -> FusedWeights | None:
        """``adapter``'s targets in this layer as one shrink and an expand each (made once per adapter)."""
        key = id(self)
        if key in adapter.fused:
            return adapter.fused[key]
        found = [(adapter.modules[t], off, width) for t, off, width in self.parts if t in adapter.modules]
        fused = None
        if found:
            parts, r0 = [], 0
            for w, off, width in found:
                r = w.a.shape[0]
                parts.append((off, width, r0, r0 + r, w.b.t().contiguous()))
                r0 += r
            fused = FusedWeights(torch.cat([w.a * w.scale for w, _, _ in found]).t().contiguous(), parts)
        adapter.fused[key] = fused
        return fused

    def _launch(self, x: torch.Tensor, out: torch.Tensor, step: LoraStep) -> None:
        from sluice.kernels.lora import lora_delta_

        assert step.kernel is not None
        for target, offset, width in self.parts:
            stack = self._stack(target, step.kernel.adapters)
            if stack is not None:
                lora_delta_(out[:, offset : offset + width], x, step.kernel.slots, *stack)

    def _stack(self, target: str,
               adapters: list[LoraAdapter]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The groups' A and B for ``target`` as ``[L, R, K]`` and ``[L, N, R]`` (lower ranks zero-padded,
        a group whose adapter skips the target all zeros) and their scales; None if none targets it.
        Rebuilt only when the step's adapters change."""
        key = tuple(a.key for a in adapters)
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


def _expand(rows: torch.Tensor, s: torch.Tensor, f: FusedWeights) -> None:
    """Add one run's expands to its output ``rows``: each target's B times its columns of the shrink ``s``."""
    for col, width, r0, r1, b_t in f.parts:
        rows[:, col : col + width].addmm_(s[:, r0:r1], b_t)


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
