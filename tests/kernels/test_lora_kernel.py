"""The Triton LoRA kernel (kernels/lora.py) against the PyTorch row-group path it would replace on CUDA:
float32, under TRITON_INTERPRET=1 on CPU (on the GPU with SLUICE_TEST_DEVICE=cuda)."""

from __future__ import annotations

import pytest
import torch
from helpers import TEST_DEVICE, fresh_seed
from sluice.kernels.lora import lora_delta_


def _reference(out: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, ranks: list[int], a: torch.Tensor,
               b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What engine/lora/layers.py computes: per adapter, its rows' B(A(x)) * scale added."""
    out = out.clone()
    for slot, r in enumerate(ranks):
        rows = torch.nonzero(idx == slot).flatten()
        if len(rows):
            delta = torch.nn.functional.linear(torch.nn.functional.linear(x[rows], a[slot, :r]), b[slot, :, :r])
            out[rows] += delta * scale[slot]
    return out


@pytest.mark.parametrize(("t", "k", "n", "ranks"), [(1, 64, 64, [8]), (13, 96, 200, [4, 16, 2, 8]),
                                                    (40, 130, 72, [16, 1, 7])])
def test_kernel_matches_the_row_group_path(t: int, k: int, n: int, ranks: list[int]) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    r = max(ranks)
    a = torch.zeros(len(ranks), r, k)
    b = torch.zeros(len(ranks), n, r)
    for slot, rank in enumerate(ranks):  # lower ranks zero-padded, as the stack holds them
        a[slot, :rank] = torch.randn(rank, k, generator=gen) * 0.1
        b[slot, :, :rank] = torch.randn(n, rank, generator=gen) * 0.1
    scale = torch.rand(len(ranks), generator=gen) * 4
    x = torch.randn(t, k, generator=gen)
    idx = torch.randint(-1, len(ranks), (t,), generator=gen, dtype=torch.int32)
    wide = torch.randn(t, n + 24, generator=gen)  # the target is a column slice of a fused output
    want = _reference(wide[:, 8 : 8 + n], x, idx, ranks, a, b, scale)
    dev = torch.device(TEST_DEVICE)
    got = wide.to(dev)
    lora_delta_(got[:, 8 : 8 + n], x.to(dev), idx.to(dev), a.to(dev), b.to(dev), scale.to(dev))
    got = got.cpu()
    torch.testing.assert_close(got[:, 8 : 8 + n], want, rtol=1e-5, atol=1e-5)
    # Columns outside the slice, and base rows, untouched.
    assert torch.equal(got[:, :8], wide[:, :8]) and torch.equal(got[:, 8 + n :], wide[:, 8 + n :])
    base = idx == -1
    assert torch.equal(got[base], wide[base])
