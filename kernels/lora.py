"""LoRA deltas for a batch of rows on mixed adapters, one launch (Triton; CUDA, or the interpreter).

Each row ``t`` of ``x`` names a slot ``idx[t]`` of the stacked adapters (-1: the base, no delta) and
gets ``out[t] += (x[t] @ A[slot]^T @ B[slot]^T) * scale[slot]``: a gathered matrix-vector product
per row (as punica's BGMV), both halves in one program. Adapters of lower rank are zero-padded to the
stack's rank, which adds nothing. ``out`` may be a column slice of a wider output (a fused q/k/v).
The shrink's result is rounded to the input's dtype before the expand, as two separate matmuls in
that dtype would round it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_kernel(
    x_ptr, out_ptr, idx_ptr, a_ptr, b_ptr, scale_ptr,
    K, N, R,
    stride_xt, stride_xk,
    stride_ot, stride_on,
    stride_al, stride_ar, stride_ak,
    stride_bl, stride_bn, stride_br,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(idx_ptr + t).to(tl.int64)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        r_ok = r < R
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            xk = tl.load(x_ptr + t * stride_xt + k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_al + r[:, None] * stride_ar + k[None, :] * stride_ak,
                        mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * xk[None, :], axis=1)
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        b = tl.load(b_ptr + slot * stride_bl + n[:, None] * stride_bn + r[None, :] * stride_br,
                    mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(b * acc[None, :], axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
        delta = delta * tl.load(scale_ptr + slot)
        o = out_ptr + t * stride_ot + n * stride_on
        y = tl.load(o, mask=n_ok, other=0.0).to(tl.float32) + delta
        tl.store(o, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def lora_delta_(out: torch.Tensor, x: torch.Tensor, idx: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scale: torch.Tensor, block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """Add each row's adapter delta to ``out`` ``[T, N]`` in place. ``x`` ``[T, K]``; ``idx`` ``[T]`` int
    (-1: none); ``a`` ``[L, R, K]``, ``b`` ``[L, N, R]``, ``scale`` ``[L]`` float32."""
    t, k = x.shape
    n = out.shape[1]
    num_slots, r, _ = a.shape
    assert out.shape[0] == t and idx.shape == (t,) and a.shape[2] == k and b.shape == (num_slots, n, r)
    if t == 0:
        return out
    grid = (t, triton.cdiv(n, block_n))
    _lora_kernel[grid](
        x, out, idx, a, b, scale,
        k, n, r,
        x.stride(0), x.stride(1),
        out.stride(0), out.stride(1),
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        BLOCK_K=block_k, BLOCK_N=block_n, BLOCK_R=max(16, triton.next_power_of_2(r)),
    )
    return out
