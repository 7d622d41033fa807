"""Section 2: decode and prefill attention time and bandwidth, against the device's copy bandwidth."""

from __future__ import annotations

from functools import partial
from typing import Any

from bench.gpu_checks.common import H200_TBS, Plan, Reporter, Row, time_ms
from bench.gpu_checks.correctness import head_major_cache

# ---- 2. kernel speed --------------------------------------------------------------------------------


def copy_bandwidth(plan: Plan) -> float:
    """GB/s of a plain device-to-device copy, counting the bytes read and the bytes written."""
    import torch

    src = torch.empty(plan.copy_mib << 20, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), plan.device)
    return 2 * src.numel() / ms / 1e6


def _sdpa_decode_ms(plan: Plan, q: Any, batch: int, ctx: int, hkv: int, d: int, dtype: Any) -> float | None:
    """torch SDPA over contiguous K/V of the same size: a yardstick, not paged."""
    import torch
    import torch.nn.functional as F

    try:
        k = torch.randn(batch, hkv, ctx, d, device=plan.device).to(dtype)
        v = torch.randn_like(k)
        q4 = q[:, :, None, :]
        return time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True), plan.device)
    except Exception as e:  # an old torch without enable_gqa, or no kernel for the shape
        print(f"sdpa yardstick skipped: {e!r}")
        return None


def bench_decode(plan: Plan, copy_gbs: float, rows: Reporter) -> None:
    import torch

    for batch in plan.decode_batches:
        for ctx in plan.decode_contexts:
            row, data = _decode_point(plan, batch, ctx, copy_gbs)
            rows.append(row, **data)
            if plan.device == "cuda":
                torch.cuda.empty_cache()  # the 8k x 256 cache alone is 4 GiB


def _decode_point(plan: Plan, batch: int, ctx: int, copy_gbs: float) -> tuple[Row, dict[str, Any]]:
    """Every sequence at ``ctx`` tokens, blocks shuffled as a long-running cache leaves them."""
    import torch
    from sluice.kernels.paged_attention import paged_decode_attention, pick_num_splits

    hq, hkv, d, bs = 32, 8, 64, 16  # Llama-3.2-1B's attention
    dtype = getattr(torch, plan.decode_dtype)
    num_blocks = batch * ctx // bs
    # The engine's head-major cache, as its decode steps read it.
    k_cache, v_cache = (head_major_cache(plan, num_blocks, bs, hkv, d, dtype).normal_() for _ in range(2))
    tables = torch.randperm(num_blocks, device=plan.device).view(batch, -1).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=plan.device)
    q = torch.randn(batch, hq, d, device=plan.device).to(dtype)
    chosen = pick_num_splits(batch, hkv, ctx, q.device)
    times = {
        s: time_ms(
            partial(paged_decode_attention, q, k_cache, v_cache, tables, seq_lens, d**-0.5, s), plan.device
        )
        for s in sorted({chosen, *plan.split_sweep})
    }
    gb = 2 * k_cache.numel() * k_cache.element_size() / 1e9  # K and V, every token read once
    best = min(times, key=times.__getitem__)
    sdpa = _sdpa_decode_ms(plan, q, batch, ctx, hkv, d, dtype)
    bw = gb / times[chosen] * 1e3
    sweep = " ".join(f"{s}:{gb / t * 1e3:.0f}" for s, t in times.items())
    data = {"batch": batch, "context": ctx, "splits": chosen, "us": times[chosen] * 1e3, "gb_per_s": bw,
            "gb_per_s_by_splits": {s: gb / t * 1e3 for s, t in times.items()}}
    return (
        "decode",
        f"B={batch} ctx={ctx}",
        f"{times[chosen] * 1e3:.0f} us {bw:.0f} GB/s = {bw / copy_gbs:.0%} of copy, "
        f"{bw / (H200_TBS * 1e3):.0%} of {H200_TBS} TB/s",
        f"splits={chosen} (best {best}: {gb / times[best] * 1e3:.0f} GB/s); GB/s by splits {sweep}; "
        + (f"sdpa contiguous {sdpa * 1e3:.0f} us" if sdpa else "sdpa n/a"),
    ), data


def bench_prefill(plan: Plan, rows: Reporter) -> None:
    import torch
    import torch.nn.functional as F
    from sluice.kernels.paged_attention import paged_prefill_attention

    hq, hkv, d, bs = 32, 8, 64, 16
    dtype = getattr(torch, plan.decode_dtype)
    n, length = plan.prefill_batch, plan.prefill_len
    num_blocks = n * length // bs
    # The engine's head-major cache, as its decode steps read it.
    k_cache, v_cache = (head_major_cache(plan, num_blocks, bs, hkv, d, dtype).normal_() for _ in range(2))
    tables = torch.randperm(num_blocks, device=plan.device).view(n, -1).int()
    seq_lens = torch.full((n,), length, dtype=torch.int32, device=plan.device)
    qsl = torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device=plan.device)
    q = torch.randn(n * length, hq, d, device=plan.device).to(dtype)
    ms = time_ms(
        lambda: paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, length, d**-0.5),
        plan.device,
    )
    flops = n * hq * 2 * length * length * d  # QK^T and PV, 2 flops per multiply-add, causal half
    q4 = q.view(n, length, hq, d).transpose(1, 2)
    k4 = k_cache.reshape(n, length, hkv, d).transpose(1, 2)  # same values, contiguous per sequence
    try:
        sdpa = time_ms(
            lambda: F.scaled_dot_product_attention(q4, k4, k4, is_causal=True, enable_gqa=True), plan.device
        )
        yard = f"sdpa contiguous {flops / sdpa / 1e9:.0f} TFLOP/s"
    except Exception as e:
        yard = f"sdpa n/a ({type(e).__name__})"
    rows.append(("prefill", f"{n} x {length} fresh", f"{ms:.2f} ms {flops / ms / 1e9:.0f} TFLOP/s", yard))




def copy_bandwidth_row(plan: Plan, rows: Reporter) -> float:
    gbs = copy_bandwidth(plan)
    rows.append(
        ("decode", "copy bandwidth", f"{gbs:.0f} GB/s", f"{plan.copy_mib} MiB device copy, read + write")
    )
    return gbs
