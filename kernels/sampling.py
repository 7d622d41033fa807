"""Exp(1) noise for seeded sampling rows, every row in one launch (engine/sampler.py, on CUDA).

A seeded request's noise comes from Philox keyed by its seed and its draw number (how many tokens it has
sampled), so its text depends on neither what else shares the batch nor the step it runs in, and a
recomputed sequence (after preemption) draws again what it drew before. One generator per request
would cost a launch per row. Seeds are taken modulo 2**32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _seeded_exponential_kernel(out_ptr, rows_ptr, keys_ptr, stride_o, n_cols, BLOCK: tl.constexpr):
    """One program per (seeded row, tile of columns)."""
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    row = tl.load(rows_ptr + i).to(tl.int64)
    key = tl.load(keys_ptr + i)  # (draw number << 32) | seed: one Philox key per row and draw
    u = tl.rand(key, cols)  # [0, 1)
    # -log(1 - u) is Exp(1); a 0 (u rounds to 0) is lifted so that p / noise stays finite and 0 / noise is 0.
    noise = tl.maximum(-tl.log(1.0 - u), 1e-20)
    tl.store(out_ptr + row * stride_o + cols, noise, mask=ok)


def philox_keys(seeds: list[int], draws: list[int]) -> list[int]:
    """``(draw << 32) | (seed mod 2**32)`` per row (an int64): distinct for every (seed, draw) pair."""
    return [(d << 32) | (s & 0xFFFFFFFF) for s, d in zip(seeds, draws, strict=True)]


def seeded_exponential(out: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Fill ``out[rows[i]]`` (``out`` [N, V] float32) with Exp(1) noise from Philox key ``keys[i]``."""
    assert out.dim() == 2 and out.stride(1) == 1 and out.dtype == torch.float32, (out.shape, out.dtype)
    assert rows.shape == keys.shape and keys.dtype == torch.int64, (rows.shape, keys.shape, keys.dtype)
    if rows.numel():
        grid = (rows.numel(), triton.cdiv(out.shape[1], BLOCK))
        _seeded_exponential_kernel[grid](out, rows, keys, out.stride(0), out.shape[1], BLOCK=BLOCK, num_warps=4)
    return out
