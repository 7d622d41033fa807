"""The C++ CPU paged-attention kernels against a float64 reference, over random ragged batches of decodes
and prompt chunks, random block tables, GQA groups, head sizes (the AVX-512 ones and a generic one),
dtypes, sliding windows and soft-capping: the GEMM kernel on the matrix units (oneDNN's brgemm: AMX where
present, AVX-512 elsewhere), the vector kernel (AVX-512, and the generic loops of a portable build), and
the default that sends prompt tiles to the first and small tiles to the second; and the engine backend
built on them."""

from __future__ import annotations

import math
import os
import platform
import random
import time
from collections.abc import Callable

import pytest
import torch
from helpers import fresh_seed
from sluice.engine.attention import AttentionMetadata, TorchAttention, allocate_kv, head_major
from sluice.engine.attention import store_kv as store_kv_torch
from sluice.engine.cpu_attention import CpuPagedAttention
from sluice.kernels.cpu_ops import (
    CFLAGS,
    SOURCES,
    attention_isa,
    attention_kernel,
    available,
    load,
    load_variant,
    paged_attention,
    store_kv,
)
from sluice.kernels.reference import paged_attention_reference, relative_error

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def random_step(rng: random.Random, dtype: torch.dtype, head_dim: int, group: int, num_kv_heads: int,
                block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step of decodes and prompt chunks over a cache whose blocks are handed out in random order."""
    num_seqs = rng.randint(1, 12)
    seq_lens = [rng.choice([1, 2, rng.randint(1, 80), rng.randint(100, 600)]) for _ in range(num_seqs)]
    q_lens = [1 if rng.random() < 0.6 else rng.randint(1, n) for n in seq_lens]
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = num_seqs * width + 3
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables = torch.tensor(order[: num_seqs * width], dtype=torch.int32).view(num_seqs, width)
    k_cache = allocate_kv(num_blocks, block_size, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    v_cache = allocate_kv(num_blocks, block_size, num_kv_heads, head_dim, dtype, torch.device("cpu"))
    k_cache.copy_(torch.randn(k_cache.shape))
    v_cache.copy_(torch.randn(v_cache.shape))
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.nn.functional.pad(q_lens_t.cumsum(0, dtype=torch.int32), (1, 0)),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        slot_mapping=torch.empty(0, dtype=torch.long),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        decode_idx=torch.nonzero(q_lens_t == 1).flatten(),
        prefill_idx=torch.nonzero(q_lens_t > 1).flatten(),
    )
    # A query row sliced out of a wider projection, as the model hands it over (rows not contiguous).
    q = torch.randn(sum(q_lens), num_kv_heads * group + 2, head_dim).to(dtype)[:, : num_kv_heads * group]
    return q, k_cache, v_cache, meta


def test_the_op_builds_here() -> None:
    ok, why = available()
    assert ok, f"the C++ attention op did not build: {why}"


Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float, int | None,
                float | None], object]


def check_against_reference(run: Run, dtype: torch.dtype, head_dim: int) -> None:
    """Four random steps (GQA groups, block sizes, windows, soft-caps) through ``run``, each against the
    float64 reference."""
    rng = random.Random(fresh_seed())
    torch.manual_seed(rng.randrange(2**31))
    for _ in range(4):
        group, kv_heads = rng.choice([(1, 4), (3, 3), (8, 1), (2, 2)])
        block_size = rng.choice([16, 32])
        window = rng.choice([None, None, rng.randint(1, 64)])
        cap = rng.choice([None, 30.0])
        q, k_cache, v_cache, meta = random_step(rng, dtype, head_dim, group, kv_heads, block_size)
        scale = 1 / math.sqrt(head_dim) * rng.choice([1.0, 4.0])
        out = torch.empty(q.shape, dtype=dtype)
        run(out, q, head_major(k_cache), head_major(v_cache), meta, scale, window, cap)
        ref = paged_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens.tolist(),
                                        (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist(), scale, window, cap)
        err = relative_error(out, ref)
        assert err < TOLERANCE[dtype], f"relative error {err} (group {group}, block {block_size}, window {window}, cap {cap})"


KERNELS = ["vector", "gemm", None]  # None: the default split between the two


def skip_unless_gemm(kernel: str | None, dtype: torch.dtype, head_dim: int) -> None:
    if kernel == "gemm" and attention_kernel(dtype, head_dim) != "gemm":
        pytest.skip(f"oneDNN's brgemm takes no {dtype} here (bfloat16 needs AVX-512; float16 is not wired)")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_op_matches_reference(dtype: torch.dtype, head_dim: int, kernel: str | None) -> None:
    skip_unless_gemm(kernel, dtype, head_dim)

    def run(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
            scale: float, window: int | None, cap: float | None) -> None:
        paged_attention(out, q, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window, cap,
                        kernel=kernel)

    check_against_reference(run, dtype, head_dim)


def test_prompt_tiles_take_the_matrix_units_where_onednn_has_them() -> None:
    """float32 everywhere oneDNN's micro-kernel runs (AVX2 and up) and bfloat16 from AVX-512 on go to the
    GEMM kernel; float16 and odd head sizes stay on the vector kernel."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX512", "AMX") or capability.startswith("AVX512"):
        assert attention_kernel(torch.bfloat16, 64) == "gemm"
        assert attention_kernel(torch.float32, 128) == "gemm"
    assert attention_kernel(torch.float16, 64) == "vector"
    assert attention_kernel(torch.float32, 63) == "vector"


def _cpu_flags() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


@pytest.mark.skipif(not {"amx_bf16", "amx_tile"} <= _cpu_flags(), reason="this CPU has no AMX (amx_bf16, amx_tile)")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_amx_runs_the_bfloat16_gemm_kernel_and_matches_reference(head_dim: int) -> None:
    """On a CPU with AMX, oneDNN packs bfloat16 for its tiles (cpublas::could_pack), the kernel reports AMX,
    and prompt tiles and decodes forced onto it match the reference."""
    assert bool(load().cpu_has_amx()), "the CPU has AMX but oneDNN does not use it (an old torch, or ONEDNN_MAX_CPU_ISA)"
    assert attention_isa(torch.bfloat16, head_dim) == "amx"

    def run(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
            scale: float, window: int | None, cap: float | None) -> None:
        paged_attention(out, q, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window, cap,
                        kernel="gemm")

    check_against_reference(run, torch.bfloat16, head_dim)


def long_prompt_step(rng: random.Random, dtype: torch.dtype, head_dim: int, group: int, kv_heads: int,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Long prompt chunks (many 16-row query tiles, lengths not a multiple of 16, a chunk that starts
    after earlier context), beside a decode, over randomly placed blocks."""
    q_lens = [rng.randint(150, 330), rng.randint(17, 90), 1]
    seq_lens = [q_lens[0] + rng.choice([0, rng.randint(1, 200)]), q_lens[1] + rng.randint(100, 300), rng.randint(50, 400)]
    width = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * width + 2
    order = list(range(num_blocks))
    rng.shuffle(order)
    tables = torch.tensor(order[: len(seq_lens) * width], dtype=torch.int32).view(len(seq_lens), width)
    k_cache, v_cache = (allocate_kv(num_blocks, block_size, kv_heads, head_dim, dtype, torch.device("cpu"))
                        for _ in range(2))
    k_cache.copy_(torch.randn(k_cache.shape))
    v_cache.copy_(torch.randn(v_cache.shape))
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.nn.functional.pad(q_lens_t.cumsum(0, dtype=torch.int32), (1, 0)),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), slot_mapping=torch.empty(0, dtype=torch.long),
        block_tables=tables, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        decode_idx=torch.nonzero(q_lens_t == 1).flatten(), prefill_idx=torch.nonzero(q_lens_t > 1).flatten())
    q = torch.randn(sum(q_lens), kv_heads * group, head_dim).to(dtype)
    return q, k_cache, v_cache, meta


@pytest.mark.parametrize("kernel", ["vector", "gemm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_long_prompt_chunks_match_reference_and_their_rows_alone(dtype: torch.dtype, head_dim: int,
                                                                 kernel: str) -> None:
    """Query tiles over long prompt chunks (GQA groups, block sizes, windows, soft-caps) against the float64
    reference; and, within one kernel, every row to the bit as when it is attended alone (as a decode at
    its position): each kernel's row does not depend on the tile it is in. (The default sends a decode to
    the vector kernel and a prompt tile to the GEMM one, whose sums run in another order: there a row
    agrees with itself alone within rounding, test_a_prompt_in_chunks_matches_it_whole.)"""
    skip_unless_gemm(kernel, dtype, head_dim)
    rng = random.Random(fresh_seed())
    torch.manual_seed(rng.randrange(2**31))
    for group, kv_heads in rng.sample([(1, 2), (3, 3), (8, 1), (4, 2)], 2):
        block_size = rng.choice([16, 32])
        window = rng.choice([None, rng.randint(20, 120)])
        cap = rng.choice([None, 30.0])
        q, k_cache, v_cache, meta = long_prompt_step(rng, dtype, head_dim, group, kv_heads, block_size)
        k_hm, v_hm, scale = head_major(k_cache), head_major(v_cache), head_dim**-0.5
        out = torch.empty(q.shape, dtype=dtype)
        paged_attention(out, q, k_hm, v_hm, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window, cap,
                        kernel=kernel)
        q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
        ref = paged_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens.tolist(), q_lens, scale,
                                        window, cap)
        err = relative_error(out, ref)
        what = f"group {group}, block {block_size}, window {window}, cap {cap}"
        assert err < TOLERANCE[dtype], f"relative error {err} ({what})"
        starts = meta.query_start_loc.tolist()
        for row in rng.sample(range(starts[1]), 12) + [0, 15, 16, starts[1] - 1, starts[2] - 1]:
            b = 0 if row < starts[1] else 1
            pos = int(meta.seq_lens[b]) - q_lens[b] + row - starts[b]
            alone = torch.empty_like(out[row : row + 1])
            paged_attention(alone, q[row : row + 1], k_hm, v_hm, meta.block_tables[b : b + 1],
                            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([pos + 1], dtype=torch.int32), scale,
                            window, cap, kernel=kernel)
            assert torch.equal(alone[0], out[row]), f"row {row} (position {pos}) differs alone ({what})"


def _cpu_seconds_by_thread() -> dict[str, float]:
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        seconds[tid] = (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return seconds


@pytest.mark.skipif((os.cpu_count() or 1) < 2 or not os.path.isdir("/proc/self/task"),
                    reason="needs two cores and Linux's per-thread CPU times")
def test_the_op_runs_on_more_than_one_thread() -> None:
    """at::parallel_for is an OpenMP pragma in torch's headers: built without -fopenmp the op ran every
    item on the calling thread, whatever torch's thread count (it did, unnoticed, for a while)."""
    rng = random.Random(fresh_seed())
    torch.manual_seed(rng.randrange(2**31))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        num_seqs, context, block_size = 64, 512, 16
        width = context // block_size
        k_cache, v_cache = (allocate_kv(num_seqs * width, block_size, 2, 64, torch.float32, torch.device("cpu"))
                            for _ in range(2))
        k_cache.copy_(torch.randn(k_cache.shape))
        v_cache.copy_(torch.randn(v_cache.shape))
        tables = torch.randperm(num_seqs * width, dtype=torch.int32).view(num_seqs, width)
        q = torch.randn(num_seqs, 8, 64)
        out = torch.empty_like(q)
        lens = torch.full((num_seqs,), context, dtype=torch.int32)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32)
        paged_attention(out, q, head_major(k_cache), head_major(v_cache), tables, qsl, lens, 0.125, None, None)
        before, started = _cpu_seconds_by_thread(), time.monotonic()
        used = [0.0]
        # Until the busiest thread has 0.4 CPU-seconds (the times tick by 10 ms), however long that takes
        # on a loaded machine: a second of wall time gave each thread 0.11 s under another's load.
        while used[0] < 0.4 and time.monotonic() - started < 120:
            for _ in range(5):
                paged_attention(out, q, head_major(k_cache), head_major(v_cache), tables, qsl, lens, 0.125, None, None)
            after = _cpu_seconds_by_thread()
            used = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    finally:
        torch.set_num_threads(threads)
    assert used[0] > 0.3, f"the op hardly ran ({used[:3]} CPU seconds by thread)"
    assert used[1] > 0.25 * used[0], f"one thread did the work: CPU seconds by thread {used[:3]}"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the portable build's flags name an x86-64 level")
def test_the_build_without_avx512_matches_reference() -> None:
    """CPUs without AVX-512 take the generic loops (scores, values, the softmax's exp); built here with
    -march=x86-64-v2 so this machine runs them too."""
    flags = [f for f in CFLAGS if not f.startswith("-march")] + ["-march=x86-64-v2"]
    op = load_variant(SOURCES[0], "sluice_portable", flags)

    def run(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
            scale: float, window: int | None, cap: float | None) -> None:
        op(out, q, k, v, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale, window or 0, cap or 0.0)

    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (64, 40):
            check_against_reference(run, dtype, head_dim)


def test_backend_writes_then_attends_like_the_pytorch_fallback() -> None:
    """Both backends store the step's K/V first (a sequence sees its own new tokens) and agree."""
    rng = random.Random(fresh_seed())
    torch.manual_seed(rng.randrange(2**31))
    q, k_cache, v_cache, meta = random_step(rng, torch.float32, 64, 3, 3, 16)
    q_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
    slots = []
    for b, (n, m) in enumerate(zip(meta.seq_lens.tolist(), q_lens, strict=True)):
        slots += [int(meta.block_tables[b, p // 16]) * 16 + p % 16 for p in range(n - m, n)]
    meta.slot_mapping = torch.tensor(slots)
    k, v = torch.randn(len(slots), 3, 64), torch.randn(len(slots), 3, 64)
    outs = []
    for backend in (CpuPagedAttention(), TorchAttention(16)):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs.append(backend.forward(q, k, v, kc, vc, meta, 0.125))
        assert torch.equal(kc.reshape(-1, 3, 64)[meta.slot_mapping], k)
    assert relative_error(outs[0], outs[1].double()) < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_matches_the_pytorch_write(dtype: torch.dtype) -> None:
    """Strided k/v (views of a fused QKV output, as the model passes them), skipped slots, every head."""
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, heads, dim, tokens = 40, 16, 3, 64, 50
    caches = [allocate_kv(num_blocks, block_size, heads, dim, dtype, torch.device("cpu")) for _ in range(4)]
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    caches[2].copy_(caches[0])
    caches[3].copy_(caches[1])
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:7]] = -1
    qkv = torch.randn(tokens, 9 + 2 * heads, dim, generator=gen).to(dtype)
    k, v = qkv[:, 9 : 9 + heads], qkv[:, 9 + heads :]
    store_kv(k, v, head_major(caches[0]), head_major(caches[1]), slots)
    store_kv_torch(k, v, head_major(caches[2]), head_major(caches[3]), slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3]), f"seed {seed}"
    with pytest.raises(RuntimeError, match="outside the cache"):
        store_kv(k[:1], v[:1], head_major(caches[0]), head_major(caches[1]), torch.tensor([num_blocks * block_size]))


def chunk_meta(table: torch.Tensor, start: int, end: int, block_size: int) -> AttentionMetadata:
    """One sequence's prompt rows ``start:end`` as a chunk over its first ``start`` tokens, already cached."""
    slots = [int(table[p // block_size]) * block_size + p % block_size for p in range(start, end)]
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, end - start], dtype=torch.int32), seq_lens=torch.tensor([end], dtype=torch.int32),
        slot_mapping=torch.tensor(slots), block_tables=table[None], max_query_len=end - start, max_seq_len=end,
        decode_idx=torch.tensor([0]) if end - start == 1 else torch.empty(0, dtype=torch.long),
        prefill_idx=torch.empty(0, dtype=torch.long) if end - start == 1 else torch.tensor([0]))


@pytest.mark.parametrize("backend", ["cpu-vector", "cpu-gemm", "cpu", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_in_chunks_matches_it_whole(backend: str, dtype: torch.dtype) -> None:
    """A prompt attended as one chunk and as chunks split at random rows (each after the cached earlier
    ones, boundaries inside a query tile and a block) agree: to the bit on each C++ kernel alone, whose rows
    do not depend on their tile; within the tolerance on the default (a short chunk's few rows take the
    vector kernel, a long one's the GEMM kernel) and on the PyTorch fallback; all against the reference."""
    kernel = {"cpu-vector": "vector", "cpu-gemm": "gemm"}.get(backend)
    skip_unless_gemm(kernel, dtype, 64)
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(rng.randrange(2**31))
    group, kv_heads, dim, block_size = rng.choice([(3, 3, 64, 16), (8, 1, 64, 32), (2, 2, 128, 16)])
    length = rng.randint(60, 420)
    cuts = sorted(rng.sample(range(1, length), rng.randint(1, 3)))
    window = rng.choice([None, rng.randint(10, 100)])
    width = -(-length // block_size)
    table = torch.randperm(width + 3, dtype=torch.int32)[:width]
    k_cache, v_cache = (allocate_kv(width + 3, block_size, kv_heads, dim, dtype, torch.device("cpu")) for _ in range(2))
    k_cache.copy_(torch.randn(k_cache.shape))
    v_cache.copy_(torch.randn(v_cache.shape))
    q = torch.randn(length, kv_heads * group, dim).to(dtype)
    slots = chunk_meta(table, 0, length, block_size).slot_mapping
    k_new, v_new = (c.view(-1, kv_heads, dim)[slots].clone() for c in (k_cache, v_cache))  # what the cache holds
    scale = dim**-0.5

    def attend(start: int, end: int) -> torch.Tensor:
        meta = chunk_meta(table, start, end, block_size)
        if backend.startswith("cpu"):
            out = torch.empty(end - start, *q.shape[1:], dtype=dtype)
            return paged_attention(out, q[start:end], head_major(k_cache), head_major(v_cache), meta.block_tables,
                                   meta.query_start_loc, meta.seq_lens, scale, window, None, kernel=kernel)
        return TorchAttention(block_size).forward(q[start:end], k_new[start:end], v_new[start:end], k_cache, v_cache, meta,
                                                  scale, sliding_window=window)

    whole = attend(0, length)
    bounds = [0, *cuts, length]
    pieces = torch.cat([attend(a, b) for a, b in zip(bounds, bounds[1:], strict=False)])
    what = f"seed {seed}, length {length}, cuts {cuts}, window {window}, group {group}, block {block_size}"
    ref = paged_attention_reference(q, k_cache, v_cache, table[None], [length], [length], scale, window, None)
    for out in (whole, pieces):
        assert relative_error(out, ref) < TOLERANCE[dtype], what
    if kernel is not None:
        assert torch.equal(whole, pieces), what
    else:
        assert relative_error(pieces, whole.double()) < TOLERANCE[dtype], what
