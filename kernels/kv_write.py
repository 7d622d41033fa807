"""Write a step's new K/V into the paged cache: one program per token, all KV heads at once; into an int8
cache (engine/kv_quant.py) quantized, a scale per head."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    HEAD_DIM: tl.constexpr,
    NUM_ELEMS: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK: tl.constexpr,  # next power of two >= NUM_ELEMS
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    idx = tl.arange(0, BLOCK)
    # Slot -1 marks a padded token: masking both sides moves no memory for it.
    ok = (idx < NUM_ELEMS) & (slot >= 0)
    head = (idx // HEAD_DIM).to(tl.int64)  # head * stride_ch passes 2**31 in a big head-major cache
    dim = idx % HEAD_DIM
    # int64 throughout: block * stride overflows int32 once a cache holds 2**31 elements.
    block = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    k = tl.load(key_ptr + t * stride_kt + head * stride_kh + dim * stride_kd, mask=ok)
    v = tl.load(value_ptr + t * stride_vt + head * stride_vh + dim * stride_vd, mask=ok)
    k_dst = block * stride_cb + in_block * stride_cs + head * stride_ch + dim * stride_cd
    v_dst = block * stride_vcb + in_block * stride_vcs + head * stride_vch + dim * stride_vcd
    tl.store(k_cache_ptr + k_dst, k, mask=ok)
    tl.store(v_cache_ptr + v_dst, v, mask=ok)


@triton.jit
def _round_half_even(y):
    """``y`` rounded to the nearest integer, ties to even (as torch.round and the C++ write): no libdevice."""
    f = tl.floor(y)
    d = y - f
    f_even = (f - 2.0 * tl.floor(f * 0.5)) == 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(f_even, f, f + 1.0)))


@triton.jit
def _quantize_rows(src_ptr, dst_ptr, t, slot, stride_t, stride_h, stride_d, stride_cb, stride_cs, stride_ch,
                   stride_cd, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One token's rows, every head: int8 values then the row's float32 scale (max|x| / 127)."""
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    ok = (heads[:, None] < NUM_HEADS) & (dims[None, :] < HEAD_DIM) & (slot >= 0)
    x = tl.load(src_ptr + t * stride_t + heads[:, None] * stride_h + dims[None, :] * stride_d, mask=ok,
                other=0.0).to(tl.float32)
    scale = tl.max(tl.abs(x), 1) / 127.0
    q = _round_half_even(x / tl.where(scale > 0, scale, 1.0)[:, None])
    q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)
    row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads * stride_ch
    tl.store(dst_ptr + row[:, None] + dims[None, :] * stride_cd, q, mask=ok)
    scale_ptrs = (dst_ptr + row + HEAD_DIM * stride_cd).to(tl.pointer_type(tl.float32), bitcast=True)
    tl.store(scale_ptrs, scale, mask=(heads < NUM_HEADS) & (slot >= 0))


@triton.jit
def _store_kvcache_int8_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh,
                               stride_kd, stride_vt, stride_vh, stride_vd, stride_cb, stride_cs, stride_ch,
                               stride_cd, stride_vcb, stride_vcs, stride_vch, stride_vcd, NUM_HEADS: tl.constexpr,
                               HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                               BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)  # -1: a padded token, nothing stored
    _quantize_rows(key_ptr, k_cache_ptr, t, slot, stride_kt, stride_kh, stride_kd, stride_cb, stride_cs, stride_ch,
                   stride_cd, NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_SIZE)
    _quantize_rows(value_ptr, v_cache_ptr, t, slot, stride_vt, stride_vh, stride_vd, stride_vcb, stride_vcs,
                   stride_vch, stride_vcd, NUM_HEADS, HEAD_DIM, BLOCK_H, BLOCK_D, BLOCK_SIZE)


def store_kvcache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into the slots ``slot_mapping[T]`` (int64; -1 = skip).

    The caches are ``[num_blocks, block_size, Hkv, D]``; any strides are accepted, so ``key`` may be
    a view into a fused QKV projection.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    quant = k_cache.dtype == torch.int8  # rows of head_dim values and a 4-byte scale (engine/kv_quant.py)
    assert value.shape == key.shape, (value.shape, key.shape)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim + 4 * quant), k_cache.shape
    assert slot_mapping.shape == (num_tokens,), slot_mapping.shape
    assert quant or (key.dtype == k_cache.dtype and value.dtype == v_cache.dtype), (key.dtype, k_cache.dtype)
    if num_tokens == 0:
        return
    if quant:
        _store_kvcache_int8_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping, *key.stride(), *value.stride(), *k_cache.stride(),
            *v_cache.stride(), NUM_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
            BLOCK_SIZE=k_cache.shape[1], num_warps=4 if num_kv_heads * head_dim >= 512 else 1,
        )
        return
    elems = num_kv_heads * head_dim
    _store_kvcache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        HEAD_DIM=head_dim,
        NUM_ELEMS=elems,
        BLOCK=triton.next_power_of_2(elems),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4 if elems >= 512 else 1,
    )
