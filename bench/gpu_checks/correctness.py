"""Section 1: each attention kernel against the float64 PyTorch reference."""

from __future__ import annotations

import random
from typing import Any

from bench.gpu_checks.common import TOL, Plan, Reporter

# ---- 1. correctness ---------------------------------------------------------------------------------


def _ragged(rng: random.Random, n: int, max_len: int) -> list[int]:
    lens = [rng.randint(1, max_len) for _ in range(n)]
    lens[0] = max_len
    return lens


def _tables(lens: list[int], block_size: int, device: str) -> tuple[Any, int]:
    """Shuffled, distinct blocks per sequence (zero-padded rows); returns (tables, num_blocks)."""
    import torch

    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks).int()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    start = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[start : start + k]
        start += k
    return tables.to(device), num_blocks


def _check_case(
    plan: Plan, rng: random.Random, dtype_name: str, hq: int, hkv: int, d: int, bs: int
) -> dict[str, float]:
    """Relative errors of kv write (0 or inf), decode (default and 3 splits) and prefill for one shape."""
    import torch
    from sluice.kernels.kv_write import store_kvcache
    from sluice.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
    from sluice.kernels.reference import paged_attention_reference, relative_error

    dev, dtype = plan.device, getattr(torch, dtype_name)
    lens = _ragged(rng, plan.check_batch, plan.check_max_len)
    tables, num_blocks = _tables(lens, bs, dev)
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    # Fill the cache through the kernel under test, every token of every sequence.
    pos = [torch.arange(n) for n in lens]
    slots = torch.cat([tables[b, p.to(dev) // bs].long() * bs + p.to(dev) % bs for b, p in enumerate(pos)])
    key = torch.randn(len(slots), hkv, d, device=dev).to(dtype)
    value = torch.randn(len(slots), hkv, d, device=dev).to(dtype)
    store_kvcache(key, value, k_cache, v_cache, slots)
    ok = torch.equal(k_cache.view(-1, hkv, d)[slots], key) and torch.equal(
        v_cache.view(-1, hkv, d)[slots], value
    )
    errs = {"kv_write": 0.0 if ok else float("inf")}

    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    scale = d**-0.5
    q = torch.randn(len(lens), hq, d, device=dev).to(dtype)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), scale)
    errs["decode"] = relative_error(paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale), ref)
    errs["decode_3_splits"] = relative_error(
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, 3), ref
    )
    # The direct path (one split: the kernel normalises and writes, no merge), as large batches take it.
    errs["decode_1_split"] = relative_error(
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, 1), ref
    )
    # Gemma-style sliding window with logit soft-capping, across splits.
    window, cap = max(2, plan.check_max_len // 3), 2.0
    extra = dict(sliding_window=window, logits_soft_cap=cap)
    ref_w = paged_attention_reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), scale, **extra)
    errs["decode_window_softcap"] = relative_error(
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, 4, **extra), ref_w
    )

    qlens = [rng.randint(1, n) for n in lens]  # the rest is a cached prefix
    qp = torch.randn(sum(qlens), hq, d, device=dev).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    out = paged_prefill_attention(qp, k_cache, v_cache, tables, qsl, seq_lens, max(qlens), scale)
    errs["prefill"] = relative_error(
        out, paged_attention_reference(qp, k_cache, v_cache, tables, lens, qlens, scale)
    )
    out = paged_prefill_attention(qp, k_cache, v_cache, tables, qsl, seq_lens, max(qlens), scale, **extra)
    errs["prefill_window_softcap"] = relative_error(
        out, paged_attention_reference(qp, k_cache, v_cache, tables, lens, qlens, scale, **extra)
    )
    errs.update(_check_int8(key, value, slots, q, qp, qsl, tables, lens, qlens, num_blocks, bs, scale))
    return errs


def _check_int8(key: Any, value: Any, slots: Any, q: Any, qp: Any, qsl: Any, tables: Any, lens: list[int],
                qlens: list[int], num_blocks: int, bs: int, scale: float) -> dict[str, float]:
    """The 8-bit cache (--kv-cache-dtype int8): the Triton write's bytes against engine/kv_quant.py's on the
    CPU (0 or inf), decode and prefill reading it against the reference over the dequantized cache."""
    import torch
    from sluice.engine.attention import allocate_kv
    from sluice.engine.kv_quant import dequantize_rows, quantize_rows
    from sluice.kernels.kv_write import store_kvcache
    from sluice.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
    from sluice.kernels.reference import paged_attention_reference, relative_error

    hkv, d = key.shape[1], key.shape[2]
    kq, vq = (allocate_kv(num_blocks, bs, hkv, d, torch.int8, key.device).zero_() for _ in range(2))
    store_kvcache(key, value, kq, vq, slots)
    # A quotient may round the other way on the GPU: a value one step off counts as written right.
    written = all((cache.reshape(-1, hkv, cache.shape[-1])[slots].cpu().int() - quantize_rows(x.cpu()).int())
                  [..., :d].abs().max() <= 1 for cache, x in ((kq, key), (vq, value)))
    k64, v64 = dequantize_rows(kq, torch.float64), dequantize_rows(vq, torch.float64)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=q.device)
    ref = paged_attention_reference(q, k64, v64, tables, lens, [1] * len(lens), scale)
    pre = paged_prefill_attention(qp, kq, vq, tables, qsl, seq_lens, max(qlens), scale)
    return {
        "kv_write_int8": 0.0 if written else float("inf"),
        "decode_int8": relative_error(paged_decode_attention(q, kq, vq, tables, seq_lens, scale), ref),
        "decode_int8_3_splits": relative_error(paged_decode_attention(q, kq, vq, tables, seq_lens, scale, 3), ref),
        "prefill_int8": relative_error(pre, paged_attention_reference(qp, k64, v64, tables, lens, qlens, scale)),
    }


def head_major_cache(plan: Plan, num_blocks: int, bs: int, hkv: int, d: int, dtype: Any) -> Any:
    """The engine's cache layout: on the GPU ``allocate_kv`` itself; on CPU its CUDA branch (torch.empty,
    head-major, viewed ``[num_blocks, bs, hkv, d]``), since the CPU branch would touch every page."""
    import torch
    from sluice.engine.attention import allocate_kv

    if plan.device == "cuda":
        return allocate_kv(num_blocks, bs, hkv, d, dtype, torch.device("cuda"))
    return torch.empty(hkv, num_blocks, bs, d, dtype=dtype).permute(1, 2, 0, 3)


def check_big_cache(plan: Plan, rng: random.Random, dtype_name: str) -> float:
    """Write, decode (chosen splits and 1 split) and prefill over the engine's head-major cache with three KV
    heads, each head's plane past 2**30 elements: blocks at the far end and head 2 sit past 2**31, reachable
    only with int64 offsets. Returns the worst relative error (inf if the write lost a value)."""
    import torch
    from sluice.kernels.kv_write import store_kvcache
    from sluice.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
    from sluice.kernels.reference import paged_attention_reference, relative_error

    dev, dtype, bs, hkv, d, group = plan.device, getattr(torch, dtype_name), 16, 3, 64, 4
    num_blocks = 2**30 // (bs * d) + 64
    k_cache = head_major_cache(plan, num_blocks, bs, hkv, d, dtype)
    v_cache = head_major_cache(plan, num_blocks, bs, hkv, d, dtype)
    assert k_cache.stride(2) < 2**31 <= (hkv - 1) * k_cache.stride(2), k_cache.stride()
    lens = [rng.randint(40, 90), rng.randint(1, 30)]
    need = [-(-n // bs) for n in lens]
    blocks = [rng.randrange(100), *rng.sample(range(num_blocks - 64, num_blocks), sum(need) - 1)]
    tables = torch.zeros(2, max(need), dtype=torch.int32)
    tables[0, : need[0]] = torch.tensor(blocks[: need[0]])
    tables[1, : need[1]] = torch.tensor(blocks[need[0] :])
    tables = tables.to(dev)
    slots = torch.cat([tables[b, torch.arange(n, device=dev) // bs].long() * bs + torch.arange(n, device=dev) % bs
                       for b, n in enumerate(lens)])
    key = torch.randn(len(slots), hkv, d, device=dev).to(dtype)
    value = torch.randn(len(slots), hkv, d, device=dev).to(dtype)
    store_kvcache(key, value, k_cache, v_cache, slots)
    where = (slots // bs, slots % bs)
    if not (torch.equal(k_cache[where], key) and torch.equal(v_cache[where], value)):
        return float("inf")
    q = torch.randn(2, hkv * group, d, device=dev).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, lens, [1, 1], 0.125)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32, device=dev)
    outs = [paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125),
            paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, 1),
            paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, 1, 0.125)]
    worst = max(relative_error(o, ref) for o in outs)
    del k_cache, v_cache
    if dev == "cuda":
        torch.cuda.empty_cache()
    return worst


def check_correctness(plan: Plan, rng: random.Random, rows: Reporter) -> bool:
    # (Hq, Hkv, D, block size): Llama-3.2-1B, SmolLM2-135M (group 3), group 8 at head dim 128, Gemma's 256.
    shapes = [(32, 8, 64, 16), (9, 3, 64, 16), (32, 4, 128, 32), (8, 4, 256, 16)]
    all_ok = True
    for dtype_name in plan.dtypes:
        worst: dict[str, float] = {}
        for shape in shapes:
            for kernel, err in _check_case(plan, rng, dtype_name, *shape).items():
                worst[kernel] = max(worst.get(kernel, 0.0), err)
        worst["head_major_int64"] = check_big_cache(plan, rng, dtype_name)
        for kernel, err in worst.items():
            ok = err <= TOL[dtype_name]
            all_ok &= ok
            verdict = "PASS" if ok else "FAIL"
            rows.append(
                (
                    "correctness",
                    f"{kernel} {dtype_name}",
                    verdict,
                    f"max rel err {err:.1e} (tol {TOL[dtype_name]:.0e})",
                ),
                error=err,
                tol=TOL[dtype_name],
            )
    return all_ok
