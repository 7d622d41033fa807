"""The CPU LoRA hook (engine/lora/layers.py) on one fused layer, against each row's delta computed on its own,
through the C++ op (kernels/cpu/lora.cpp) and the matmul fallback: rows of several adapters and the base put
in adapter order (one run each) or left interleaved (many runs), adapters that target only some of the
layer's parts, base rows left bit-identical; and the batch order (engine/lora/batch.py) that makes one run
per adapter."""

from __future__ import annotations

import platform
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fresh_seed
from sluice.engine.lora.adapters import LoraAdapter, LoraWeights
from sluice.engine.lora.batch import adapter_order, adapter_runs
from sluice.engine.lora.layers import CpuStep, LoraHook, LoraStep
from sluice.kernels import cpu_ops

# A fused q/k/v output: (target, first column, width). "small": widths and stacked rank (14) below one
# vector of the C++ op; "wide": past its tiles (widths over 64 columns, ranks stacking to 120 > 96 columns).
SHAPES = {
    "small": (24, [("q", 0, 16), ("k", 16, 8), ("v", 24, 8)], {"all": 4, "k-only": 2, "qv": 8}),
    "wide": (72, [("q", 0, 80), ("k", 80, 40), ("v", 120, 24)], {"all": 40, "k-only": 17, "qv": 33}),
}
TARGETS = {"all": ["q", "k", "v"], "k-only": ["k"], "qv": ["q", "v"]}


def _portable_op() -> Any:
    flags = [f for f in cpu_ops.CFLAGS if not f.startswith("-march")] + ["-march=x86-64-v2"]
    source = next(s for s in cpu_ops.SOURCES if s.name == "lora.cpp")
    return cpu_ops.load_variant(Path(source), "sluice_lora_portable", flags, op="lora_add_")


def _adapter(name: str, gen: torch.Generator, rank: int, targets: list[str], fan_in: int,
             parts: list[tuple[str, int, int]]) -> LoraAdapter:
    widths = {t: w for t, _, w in parts}
    modules = {t: LoraWeights(torch.randn(rank, fan_in, generator=gen) * 0.1, torch.randn(widths[t], rank, generator=gen) * 0.1,
                              float(torch.rand((), generator=gen)) * 4) for t in targets}
    return LoraAdapter(name, "-", rank, modules)


def _reference(x: torch.Tensor, out: torch.Tensor, names: list[str | None], adapters: dict[str, LoraAdapter],
               parts: list[tuple[str, int, int]]) -> torch.Tensor:
    want = out.double()
    for row, name in enumerate(names):
        if name is None:
            continue
        for target, offset, width in parts:
            w = adapters[name].modules.get(target)
            if w is not None:
                want[row, offset : offset + width] += (x[row].double() @ w.a.T.double() @ w.b.T.double()) * w.scale
    return want.to(out.dtype)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize(("path", "dtype"), [("cpu-op", torch.float32), ("cpu-op", torch.bfloat16),
                                             ("portable", torch.float32), ("matmul", torch.float32)])
@pytest.mark.parametrize("layout", ["adapter-order", "interleaved"])
def test_hook_matches_each_rows_own_delta(layout: str, path: str, dtype: torch.dtype, shape: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """``portable``: the C++ op built for x86-64-v2 (no AVX-512), so this machine runs its generic loops."""
    if path != "matmul" and not cpu_ops.available()[0]:
        pytest.skip(f"the C++ CPU ops do not build here: {cpu_ops.available()[1]}")
    if path == "portable":
        if platform.machine() != "x86_64":
            pytest.skip("the portable build's flags name an x86-64 level")
        monkeypatch.setattr(cpu_ops, "lora_add_", _portable_op())
    seed = fresh_seed()
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    fan_in, parts, ranks = SHAPES[shape]
    adapters = {n: _adapter(n, gen, ranks[n], TARGETS[n], fan_in, parts) for n in TARGETS}
    seq_names: list[str | None] = [rng.choice([None, *adapters]) for _ in range(30)]
    seq_names[:4] = [None, "all", "k-only", "qv"]  # every adapter and the base present
    q_lens = [rng.choice([1, 1, 3, 6]) for _ in seq_names]  # decodes and prompt chunks: blocks cut mid-run
    order = adapter_order(seq_names)
    assert order is not None and sorted(order) == list(range(len(seq_names)))
    if layout != "interleaved":
        seq_names, q_lens = [seq_names[i] for i in order], [q_lens[i] for i in order]
    runs = adapter_runs(seq_names, q_lens)
    if layout != "interleaved":
        assert [name for name, _, _ in runs] == ["all", "k-only", "qv"]
    else:
        assert len(runs) > len(adapters)  # some adapter split over runs: still right
    names = [n for n, q in zip(seq_names, q_lens, strict=True) for _ in range(q)]  # per packed row
    step = LoraStep([(adapters[n], a, b) for n, a, b in runs], torch.empty(len(names) * max(ranks.values()) * 3,
                                                                              dtype=dtype))
    if path != "matmul":  # slots in name order, as the manager makes them
        slot = {n: i for i, n in enumerate(sorted(adapters))}
        step.cpu = CpuStep([adapters[n] for n in sorted(adapters)],
                           torch.tensor([(a, b, slot[n]) for n, a, b in runs], dtype=torch.int64),
                           tuple(adapters[n].key for n in sorted(adapters)))
    for a in adapters.values():
        for w in a.modules.values():
            w.a, w.b = w.a.to(dtype), w.b.to(dtype)
    hook = LoraHook(parts=list(parts), step=step)
    x = torch.randn(len(names), fan_in, generator=gen).to(dtype)
    out = torch.randn(len(names), parts[-1][1] + parts[-1][2], generator=gen).to(dtype)
    want = _reference(x, out, names, adapters, parts)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    hook(torch.nn.Identity(), (x,), out)
    torch.testing.assert_close(out, want, **tol, msg=lambda m: f"{m} (seed {seed})")
    base = [i for i, n in enumerate(names) if n is None]
    assert torch.equal(out[base], want[base])  # the base rows untouched, to the bit
    if path != "matmul":  # a second step on the same adapters reuses the stacked weights; fresh rows, same rule
        assert step.cpu is not None and hook.stacked[0] == step.cpu.key
        stacked = hook.stacked[1]
        out2 = torch.randn(len(names), out.shape[1], generator=gen).to(dtype)
        want2 = _reference(x, out2, names, adapters, parts)
        hook(torch.nn.Identity(), (x,), out2)
        assert hook.stacked[1] is stacked
        torch.testing.assert_close(out2, want2, **tol, msg=lambda m: f"{m} (seed {seed})")


def test_adapter_order_is_one_run_per_adapter_base_first_by_name_and_stable() -> None:
    names = ["b", None, "a", "b", None, "a", "c"]
    order = adapter_order(names)
    assert order == [1, 4, 2, 5, 0, 3, 6]
    assert adapter_order([names[i] for i in order]) is None  # already in order: left as it is
    assert adapter_order(["a", "a", None, "b"]) == [2, 0, 1, 3]  # the base first: the adapters' rows back to back
    assert adapter_order([None, "a", "b"]) is None
    assert adapter_order([]) is None


def test_runs_are_packed_rows_of_consecutive_sequences() -> None:
    assert adapter_runs([None, "a", "a", "b", None], [2, 1, 3, 1, 5]) == [("a", 2, 6), ("b", 6, 7)]
    assert adapter_runs(["a", None, "a"], [1, 1, 1]) == [("a", 0, 1), ("a", 2, 3)]
