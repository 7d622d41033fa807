"""The CPU LoRA hook (engine/lora/layers.py) on one fused layer, against each row's delta computed on its own:
rows of several adapters and the base put in adapter order (one run each) or left interleaved (many runs),
adapters that target only some of the layer's parts, base rows left bit-identical; and the batch order
(engine/lora/batch.py) that makes one run per adapter."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import fresh_seed

from engine.lora.adapters import LoraAdapter, LoraWeights
from engine.lora.batch import adapter_order, adapter_runs
from engine.lora.layers import GroupedRuns, LoraHook, LoraStep

IN = 24
PARTS = [("q", 0, 16), ("k", 16, 8), ("v", 24, 8)]  # a fused q/k/v output, 32 columns wide
WIDTH = 32


def _adapter(name: str, gen: torch.Generator, rank: int, targets: list[str]) -> LoraAdapter:
    widths = {t: w for t, _, w in PARTS}
    modules = {t: LoraWeights(torch.randn(rank, IN, generator=gen) * 0.1, torch.randn(widths[t], rank, generator=gen) * 0.1,
                              float(torch.rand((), generator=gen)) * 4) for t in targets}
    return LoraAdapter(name, "-", rank, modules)


def _reference(x: torch.Tensor, out: torch.Tensor, names: list[str | None], adapters: dict[str, LoraAdapter]) -> torch.Tensor:
    want = out.clone()
    for row, name in enumerate(names):
        if name is None:
            continue
        for target, offset, width in PARTS:
            w = adapters[name].modules.get(target)
            if w is not None:
                want[row, offset : offset + width] += (x[row] @ w.a.T @ w.b.T) * w.scale
    return want


@pytest.mark.parametrize("layout", ["grouped", "adapter-order", "interleaved"])
def test_hook_matches_each_rows_own_delta(layout: str) -> None:
    seed = fresh_seed()
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    adapters = {"all": _adapter("all", gen, 4, ["q", "k", "v"]), "k-only": _adapter("k-only", gen, 2, ["k"]),
                "qv": _adapter("qv", gen, 8, ["q", "v"])}
    seq_names: list[str | None] = [rng.choice([None, *adapters]) for _ in range(30)]
    seq_names[:4] = [None, "all", "k-only", "qv"]  # every adapter and the base present
    q_lens = [rng.choice([1, 1, 3]) for _ in seq_names]  # decodes and prompt chunks
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
    step = LoraStep([(adapters[n], a, b) for n, a, b in runs], torch.empty(len(names) * 8 * 3))
    if layout == "grouped":  # one grouped GEMM per shrink and target (ranks 4, 2, 8 and targets missing: zero-padded)
        lo = runs[0][1]
        step.grouped = GroupedRuns(lo, runs[-1][2], torch.tensor([e - lo for _, _, e in runs], dtype=torch.int32),
                                   tuple(n for n, _, _ in runs))
    hook = LoraHook(parts=list(PARTS), step=step)
    x = torch.randn(len(names), IN, generator=gen)
    out = torch.randn(len(names), WIDTH, generator=gen)
    want = _reference(x, out, names, adapters)
    hook(torch.nn.Identity(), (x,), out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    base = [i for i, n in enumerate(names) if n is None]
    assert torch.equal(out[base], want[base])  # the base rows untouched, to the bit
    if layout == "grouped":  # a second step on the same adapters reuses the stacked A; fresh rows, same rule
        assert hook.grouped[0] == step.grouped.key
        out2 = torch.randn(len(names), WIDTH, generator=gen)
        want2 = _reference(x, out2, names, adapters)
        hook(torch.nn.Identity(), (x,), out2)
        torch.testing.assert_close(out2, want2, rtol=1e-5, atol=1e-5)


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
