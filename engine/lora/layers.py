"""Where an adapter's deltas land: the base model's linear layers, on either model path.

A LoRA target is named as in transformers (``model.layers.3.self_attn.q_proj``). On the native path
q/k/v and gate/up are fused, so a target is a column slice of a fused layer's output; on the
transformers path it is a whole ``nn.Linear``. A forward hook on the layer (whatever runs its GEMM:
``nn.Linear``, a packed or quantized replacement) adds each row group's delta to its output in place.

On CPU the model runner puts the step's sequences in adapter order (engine/lora/batch.py), so each
adapter's rows are one contiguous run of the packed batch, the runs back to back. Then a layer's LoRA is
a few grouped GEMMs (``torch._grouped_mm``: each run's rows against its adapter's weights), however many
adapters run: one shrink over all the layer's targets (their A side by side, scales folded in), and per
target one expand into a delta added to its columns of the output. The stacked weights are kept per hook
while the step's adapters stay the same (the order sorts adapters by name, so batch churn does not
restack). Otherwise (one run, or runs that do not lie so), per run: one shrink GEMM over the layer's
targets into a step-long scratch buffer, then one ``addmm_`` per target straight into its columns of the
output rows (a strided view: no gather, no scatter, no delta tensor). With 2 threads on a loaded
machine every small GEMM pays for its threads' barrier, so the count matters: at 4 adapters a native
decode step (120 hooks) made 480 shrink + 840 expand GEMMs the per-run way, and makes 120 + 210 grouped
GEMMs and 210 adds this way, at 16 adapters too. The per-run form measured, one layer, 160 rows, one
thread, on a loaded machine (so rough):
at 4 adapters 0.11-0.19x of the layer's base GEMM time against 0.20-0.21x for the former gathered form
(a block-diagonal expand per group, deltas added back with ``index_add_``); at 16 adapters 0.18x vs 0.31x.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
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
    """One adapter's targets within one layer's output: A stacked and transposed ``[in, R]`` with each
    target's scale folded in, and per target (output column, width, its A rows r0:r1, B^T ``[r, width]``)."""

    a_t: torch.Tensor
    parts: list[tuple[int, int, int, int, torch.Tensor]]


@dataclass
class GroupedWeights:
    """The step's adapters (one per run, in run order) in one layer, for the grouped GEMMs: A of every
    target side by side, scales folded in, ``[runs, in, R]``; per target (output column, width, its
    columns c0:c1 of the shrink, B^T ``[runs, c1 - c0, width]``). A target's columns are the widest rank
    among the adapters; an adapter of lower rank, or without the target, has zeros there."""

    a: torch.Tensor
    parts: list[tuple[int, int, int, int, torch.Tensor]]


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
    grouped: GroupedRuns | None = None  # set: the runs lie back to back, one per adapter: one grouped shrink


@dataclass
class GroupedRuns:
    """Runs that lie back to back over packed rows ``lo:hi``, one per adapter: their ends (from ``lo``) as
    the grouped GEMM reads them, and their adapters' names, which key each hook's stacked A."""

    lo: int
    hi: int
    offs: torch.Tensor  # [runs] int32
    key: tuple[str, ...]


@dataclass
class LoraHook:
    """The forward hook of one module: adds the deltas of every target that lives in its output."""

    parts: list[tuple[str, int, int]] = field(default_factory=list)  # (target, offset, width)
    step: LoraStep | None = None  # this step's adapter rows (None: no row takes an adapter); set by the manager
    # Per target: the groups' weights stacked for the kernel, and the adapters they were stacked for.
    stacks: dict[str, tuple[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]] = field(
        default_factory=dict)
    # The grouped GEMMs' weights and the adapters (one per run) they were stacked for.
    grouped: tuple[tuple[str, ...], GroupedWeights | None] = ((), None)

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        step = self.step
        if step is None:
            return
        x = args[0].reshape(-1, args[0].shape[-1])
        out = output.view(-1, output.shape[-1])
        if step.kernel is not None:
            self._launch(x, out, step)
            return
        if step.grouped is not None and _groupable(x, self.parts):
            self._grouped(x, out, step, step.grouped)
            return
        for adapter, start, end in step.runs:
            f = self._fused(adapter)
            if f is None:
                continue
            # peft's B(A(x)) * scale: every target's shrink in one GEMM, each expand added in place.
            n, r = end - start, f.a_t.shape[1]
            s = torch.mm(x[start:end], f.a_t, out=step.scratch[: n * r].view(n, r))
            _expand(out[start:end], s, f)

    def _grouped(self, x: torch.Tensor, out: torch.Tensor, step: LoraStep, g: GroupedRuns) -> None:
        stack = self._grouped_stack(step, g.key)
        if stack is None:
            return
        s = torch._grouped_mm(x[g.lo : g.hi], stack.a, offs=g.offs)  # every run's shrink: one GEMM
        rows = out[g.lo : g.hi]
        for col, width, c0, c1, b in stack.parts:  # per target, every run's expand: one GEMM, one add
            rows[:, col : col + width] += torch._grouped_mm(s[:, c0:c1], b, offs=g.offs)

    def _grouped_stack(self, step: LoraStep, key: tuple[str, ...]) -> GroupedWeights | None:
        """The runs' adapters' weights for this layer stacked for the grouped GEMMs, made when the step's
        adapters change; None if none of them targets this layer."""
        if self.grouped[0] == key:
            return self.grouped[1]
        adapters = [adapter for adapter, _, _ in step.runs]
        targets = []  # (target, col, width, its columns c0:c1 of the shrink, the runs' weights)
        c0 = 0
        for target, col, width in self.parts:
            weights = [a.modules.get(target) for a in adapters]
            rank = max((w.a.shape[0] for w in weights if w is not None), default=0)
            if rank:
                targets.append((col, width, c0, c0 + rank, weights))
                c0 += rank
        stack = None
        if targets:
            like = next(w for *_, ws in targets for w in ws if w is not None).a
            # Lower ranks and absent targets are zeros; the shrink's row 16-byte aligned, as the GEMM wants.
            a = like.new_zeros(len(adapters), like.shape[1], -(-c0 // 8) * 8)
            parts = []
            for col, width, t0, t1, weights in targets:
                b = like.new_zeros(len(adapters), t1 - t0, width)
                for i, w in enumerate(weights):
                    if w is not None:
                        r = w.a.shape[0]
                        a[i, :, t0 : t0 + r] = (w.a * w.scale).t()
                        b[i, :r] = w.b.t()
                parts.append((col, width, t0, t1, b))
            stack = GroupedWeights(a, parts)
        self.grouped = (key, stack)
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
        from kernels.lora import lora_delta_

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
        key = tuple(a.name for a in adapters)
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


def _groupable(x: torch.Tensor, parts: list[tuple[str, int, int]]) -> bool:
    """Whether torch's CPU grouped GEMM takes ``x`` and the targets' B: rows a multiple of 16 bytes apart."""
    return x.stride(1) == 1 and all(n * x.element_size() % 16 == 0 for n in (x.stride(0), *(w for _, _, w in parts)))


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
