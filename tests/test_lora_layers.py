"""The CPU LoRA hook (engine/lora/layers.py) on one fused layer, against each row's delta computed on its own:
rows of several adapters and the base interleaved (the gathered path) or in one run (the sliced path),
adapters that target only some of the layer's parts, base rows left bit-identical."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from helpers import fresh_seed

from engine.lora.adapters import LoraAdapter, LoraWeights
from engine.lora.batch import adapter_rows, as_index
from engine.lora.layers import LoraHook, LoraStep

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


@pytest.mark.parametrize("layout", ["interleaved", "one-run"])
def test_hook_matches_each_rows_own_delta(layout: str) -> None:
    seed = fresh_seed()
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    adapters = {"all": _adapter("all", gen, 4, ["q", "k", "v"]), "k-only": _adapter("k-only", gen, 2, ["k"]),
                "qv": _adapter("qv", gen, 8, ["q", "v"])}
    if layout == "interleaved":
        names: list[str | None] = [rng.choice([None, *adapters]) for _ in range(40)]
        names[:4] = [None, "all", "k-only", "qv"]  # every adapter and the base present
    else:
        names = [None] * 5 + ["qv"] * 9 + [None] * 3
    q_lens = [1] * len(names)
    rows = adapter_rows(names, q_lens)
    order = np.concatenate(list(rows.values()))
    step = LoraStep(as_index(order, torch.device("cpu")), [adapters[n] for n in rows],
                    np.cumsum([0, *(len(r) for r in rows.values())]).tolist())
    assert isinstance(step.rows, slice) == (layout == "one-run")
    hook = LoraHook(parts=list(PARTS), step=step)
    x = torch.randn(len(names), IN, generator=gen)
    out = torch.randn(len(names), WIDTH, generator=gen)
    want = _reference(x, out, names, adapters)
    hook(torch.nn.Identity(), (x,), out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    base = [i for i, n in enumerate(names) if n is None]
    assert torch.equal(out[base], want[base])  # the base rows untouched, to the bit


def test_rows_in_one_run_but_out_of_order_are_gathered() -> None:
    """Rows 2, 3, 0, 1 span four rows but are not one ascending run: a slice would take the wrong rows."""
    assert isinstance(as_index(np.array([2, 3, 0, 1]), torch.device("cpu")), torch.Tensor)
    assert as_index(np.array([3, 4, 5]), torch.device("cpu")) == slice(3, 6)
