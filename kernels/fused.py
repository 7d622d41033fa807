"""Fused elementwise kernels for the decoder layer: residual add + RMSNorm, rotary embedding, SiLU * up.

In eager PyTorch each is 6-10 kernels with float32 temporaries; at decode sizes the launches, not the
bytes, are the cost. Both follow the arithmetic of ``engine/models/llama.py`` (itself transformers'):

* RMSNorm: ``weight * (h.float() * rsqrt(mean(h.float()**2) + eps)).to(dtype)`` with ``h = x + residual``
  rounded to the activation dtype first, as the unfused ``x = x + attn(...)`` stores it;
* rotary: ``x * cos + rotate_half(x) * sin`` with the float32 tables cast to the activation dtype;
* ``F.silu(gate) * up``, the SiLU rounded to the activation dtype before the product.

kernels/cpu_fused.py has the same functions as C++ CPU ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded, as the unfused add stores it
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x [T, H]``; with ``residual``, normalise ``h = x + residual`` and
    return ``(normed, h)``, where ``h`` is the residual stream for the next layer."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],), (x.shape, weight.shape)
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1, (residual.shape, x.shape)
    res = residual if residual is not None else x
    n_cols = x.shape[1]
    block = triton.next_power_of_2(n_cols)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x,
            res,
            weight,
            out,
            res_out,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            res_out.stride(0),
            n_cols,
            eps,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 256)),
        )
    return (out, res_out) if residual is not None else out


@triton.jit
def _rotate_heads(
    x_ptr, stride_t, stride_h, t, num_heads, cos1, sin1, cos2, sin2, HALF: tl.constexpr, BLOCK_H: tl.constexpr
):
    """In place for one token: first half ``x1*cos - x2*sin``, second half ``x2*cos + x1*sin``."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HALF)
    ok = (heads < num_heads)[:, None]
    ptr = x_ptr + t * stride_t + heads[:, None] * stride_h + dims[None, :]
    x1 = tl.load(ptr, mask=ok, other=0.0)
    x2 = tl.load(ptr + HALF, mask=ok, other=0.0)
    # torch rounds each product and the sum to the activation dtype; rounding once is at least as close.
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(ptr, (a * cos1[None, :] - b * sin1[None, :]).to(x1.dtype), mask=ok)
    tl.store(ptr + HALF, (b * cos2[None, :] + a * sin2[None, :]).to(x1.dtype), mask=ok)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dims = tl.arange(0, HALF)
    dtype = q_ptr.dtype.element_ty
    # The tables are float32; the unfused model casts them to the activation dtype before use.
    cos1 = tl.load(cos_ptr + pos * stride_cos + dims).to(dtype).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + dims).to(dtype).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_sin + dims).to(dtype).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + dims).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr, stride_qt, stride_qh, t, num_q_heads, cos1, sin1, cos2, sin2, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, stride_kt, stride_kh, t, num_kv_heads, cos1, sin1, cos2, sin2, HALF, BLOCK_HK)


def rotary_supports(head_dim: int) -> bool:
    half = head_dim // 2
    return head_dim % 2 == 0 and half & (half - 1) == 0  # tl.arange needs a power-of-two half


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place (views into a fused QKV are fine) by the
    rows ``positions [T]`` of the float32 tables ``cos``/``sin`` ``[max_positions, D]``; returns (q, k)."""
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and positions.shape == (num_tokens,)
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.stride(1) == 1 and sin.stride(1) == 1
    half = head_dim // 2
    assert half == triton.next_power_of_2(half), f"head_dim {head_dim}: the kernel needs a power of two"
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q,
            k,
            cos,
            sin,
            positions,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            sin.stride(0),
            num_q_heads,
            k.shape[1],
            HALF=half,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            num_warps=4,
        )
    return q, k


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0)
    up = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # rounded, as F.silu stores it
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up [T, 2I]``."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0, gate_up.shape
    n_cols = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], n_cols)
    block = min(1024, triton.next_power_of_2(n_cols))
    if gate_up.shape[0]:
        _silu_and_mul_kernel[(gate_up.shape[0], triton.cdiv(n_cols, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), n_cols, BLOCK=block, num_warps=4
        )
    return out
