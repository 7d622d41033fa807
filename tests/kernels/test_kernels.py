"""The Triton kernels under the interpreter on CPU (compiled, on a GPU with SLUICE_TEST_DEVICE=cuda),
against a float64 PyTorch reference.

Inputs are drawn fresh each run from a printed seed (replay with SLUICE_TEST_SEED). bfloat16 is
not tested here: the interpreter computes it wrongly; bench/gpu_check.py covers it on a GPU.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import TEST_DEVICE, fresh_seed
from sluice.engine.attention import AttentionMetadata
from sluice.engine.triton_attention import TritonAttention
from sluice.kernels.kv_write import store_kvcache
from sluice.kernels.paged_attention import DECODE_BLOCK_N, paged_decode_attention, paged_prefill_attention
from sluice.kernels.reference import paged_attention_reference as reference
from sluice.kernels.reference import relative_error

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
F32, F16 = torch.float32, torch.float16


@pytest.fixture(autouse=True)
def on_test_device(request: pytest.FixtureRequest) -> Iterator[None]:
    """The kernels' tensors on the test device (SLUICE_TEST_DEVICE: cuda on a GPU, the compiled kernels;
    the interpreter here). A test that builds an engine leaves the device to the engine's own "auto"."""
    if "tiny_model_dir" in request.fixturenames:
        yield
        return
    with torch.device(TEST_DEVICE):
        yield


@pytest.fixture
def rng() -> random.Random:
    seed = fresh_seed()
    torch.manual_seed(seed)
    return random.Random(seed)


# ---- building inputs ----------------------------------------------------------------------------


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ragged_lens(rng: random.Random, batch: int, max_len: int, block_size: int) -> list[int]:
    """Random lengths in [1, max_len], one of them max_len and, where possible, one a non-multiple of the block size."""
    lens = [rng.randint(1, max_len) for _ in range(batch)]
    lens[rng.randrange(batch)] = max_len
    if batch > 1 and all(n % block_size == 0 for n in lens):
        lens[0] = max(1, lens[0] - 1)
    return lens


def block_tables_for(
    rng: random.Random, lens: list[int], block_size: int, spare_blocks: int = 7, extra_cols: int = 0
) -> tuple[torch.Tensor, int]:
    """Distinct, shuffled (non-contiguous) blocks per sequence, zero-padded; returns (tables, num_blocks)."""
    need = [cdiv(n, block_size) for n in lens]
    num_blocks = sum(need) + spare_blocks
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables = torch.zeros(len(lens), max(need) + extra_cols, dtype=torch.int32)
    for b, n in enumerate(need):
        tables[b, :n] = torch.tensor(pool[:n], dtype=torch.int32)
        del pool[:n]
    return tables, num_blocks


def random_cache(
    num_blocks: int, block_size: int, hkv: int, d: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, hkv, d)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = relative_error(out, ref)
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e}"


# ---- KV write --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,hkv,d,block_size",
    [(F32, 2, 64, 16), (F16, 3, 128, 32), (F16, 1, 64, 32)],
)
def test_store_kvcache(rng: random.Random, dtype: torch.dtype, hkv: int, d: int, block_size: int) -> None:
    num_blocks, tokens = 12, rng.randint(1, 40)
    k_cache, v_cache = random_cache(num_blocks, block_size, hkv, d, dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.tensor(rng.sample(range(num_blocks * block_size), tokens))
    skipped = torch.rand(tokens) < 0.3
    slots[skipped] = -1
    # K and V as strided views of one fused projection, as a model produces them.
    qkv = torch.randn(tokens, 2 * hkv + 1, d).to(dtype)
    key, value = qkv[:, :hkv], qkv[:, hkv : 2 * hkv]
    store_kvcache(key, value, k_cache, v_cache, slots)

    expect_k, expect_v = before_k.view(-1, hkv, d), before_v.view(-1, hkv, d)
    keep = slots >= 0
    expect_k[slots[keep]] = key[keep]
    expect_v[slots[keep]] = value[keep]
    assert torch.equal(k_cache.view(-1, hkv, d), expect_k)
    assert torch.equal(v_cache.view(-1, hkv, d), expect_v)


# ---- decode ---------------------------------------------------------------------------------------

# (dtype, head_dim, group, block_size, batch, max_len, num_splits)
DECODE_CASES = [
    pytest.param(F32, 64, 1, 16, 1, 1, None, id="one-token"),
    pytest.param(F32, 128, 3, 32, 5, 300, 4, id="gqa3-splits4"),
    pytest.param(F16, 64, 8, 16, 16, 200, 3, id="gqa8-batch16"),
    pytest.param(F16, 128, 1, 32, 2, 2000, None, id="long-heuristic-splits"),
    pytest.param(F32, 64, 8, 32, 3, 1999, 16, id="long-splits16"),
    pytest.param(F16, 128, 3, 16, 4, 150, 1, id="one-split"),
    pytest.param(F16, 256, 2, 16, 3, 300, 3, id="head-dim-256"),
]


@pytest.mark.parametrize("dtype,d,group,block_size,batch,max_len,splits", DECODE_CASES)
def test_decode(
    rng: random.Random,
    dtype: torch.dtype,
    d: int,
    group: int,
    block_size: int,
    batch: int,
    max_len: int,
    splits: int | None,
) -> None:
    hkv = 2
    lens = ragged_lens(rng, batch, max_len, block_size)
    tables, num_blocks = block_tables_for(rng, lens, block_size, extra_cols=rng.randint(0, 3))
    k_cache, v_cache = random_cache(num_blocks, block_size, hkv, d, dtype)
    q = torch.randn(batch, hkv * group, d).to(dtype)
    scale = 1 / math.sqrt(d)
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale, splits
    )
    assert_close(out, reference(q, k_cache, v_cache, tables, lens, [1] * batch, scale), dtype)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_decode_empty_splits(rng: random.Random, dtype: torch.dtype) -> None:
    """Each sequence cuts its own context into the splits, whole tiles each, over a table with room for 1024
    tokens (as a captured graph's): a 1-token sequence leaves 7 of 8 splits empty, a long one fills several."""
    block_size, d, splits = 16, 64, 8
    lens = [1, rng.randint(2, 60), rng.randint(300, 700)]
    tables, num_blocks = block_tables_for(rng, lens, block_size)
    tables = torch.cat([tables, torch.zeros(3, 64 - tables.shape[1], dtype=torch.int32)], 1)  # room for 1024
    per_split = [cdiv(cdiv(n, splits), DECODE_BLOCK_N) * DECODE_BLOCK_N for n in lens]
    assert cdiv(lens[0], per_split[0]) == 1 and 1 < cdiv(lens[2], per_split[2]) <= splits
    k_cache, v_cache = random_cache(num_blocks, block_size, 1, d, dtype)
    q = torch.randn(3, 3, d).to(dtype)
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), 0.125, splits
    )
    assert_close(out, reference(q, k_cache, v_cache, tables, lens, [1] * 3, 0.125), dtype)


# ---- prefill --------------------------------------------------------------------------------------

# (dtype, head_dim, group, block_size, cached prefix lengths, query lengths)
PREFILL_CASES = [
    pytest.param(F32, 64, 1, 16, [0, 0, 0], [1, 37, 100], id="fresh-prompts"),
    pytest.param(F16, 128, 3, 32, [5, 64, 130, 0], [20, 1, 33, 70], id="chunked-after-prefix"),
    pytest.param(F32, 128, 8, 16, [9, 40, 0, 200, 3, 17], [1, 1, 50, 1, 12, 1], id="decodes-mixed-in"),
    pytest.param(F16, 64, 8, 32, [1963, 500], [37, 1], id="long-context"),
    pytest.param(F32, 64, 3, 16, [10, 0, 77], [1, 1, 1], id="all-query-len-1"),
    # Gemma's head dim: 8 warps and half-width key tiles (kernels/paged_attention.py).
    pytest.param(F16, 256, 2, 16, [0, 90], [70, 45], id="head-dim-256"),
]


@pytest.mark.parametrize("dtype,d,group,block_size,prefix,qlens", PREFILL_CASES)
def test_prefill(
    rng: random.Random,
    dtype: torch.dtype,
    d: int,
    group: int,
    block_size: int,
    prefix: list[int],
    qlens: list[int],
) -> None:
    hkv = 2
    # Jitter the shapes a little each run so that tile edges move around.
    prefix = [max(0, p + rng.randint(-3, 3)) if p else 0 for p in prefix]
    lens = [p + m for p, m in zip(prefix, qlens, strict=True)]
    tables, num_blocks = block_tables_for(rng, lens, block_size, extra_cols=rng.randint(0, 2))
    k_cache, v_cache = random_cache(num_blocks, block_size, hkv, d, dtype)
    q = torch.randn(sum(qlens), hkv * group, d).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(d)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, max(qlens), scale)
    assert_close(out, reference(q, k_cache, v_cache, tables, lens, qlens, scale), dtype)


def test_prefill_one_long_chunk_among_many_decodes(rng: random.Random) -> None:
    """A mixed step as the scheduler makes it: one long prompt chunk and 130 decodes (past the kernel's
    128-sequence search chunk), launched per query tile, not longest query x batch."""
    dtype, d, group, block_size, hkv = F32, 16, 2, 16, 1
    pos = rng.randrange(131)
    qlens = [1] * 131
    qlens[pos] = rng.randint(70, 130)
    lens = [m + rng.randint(0, 40) for m in qlens]
    tables, num_blocks = block_tables_for(rng, lens, block_size)
    k_cache, v_cache = random_cache(num_blocks, block_size, hkv, d, dtype)
    q = torch.randn(sum(qlens), hkv * group, d)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, max(qlens), 0.25)
    assert_close(out, reference(q, k_cache, v_cache, tables, lens, qlens, 0.25), dtype)


# ---- random configurations ---------------------------------------------------------------------------
# The cases above pin the corners; these draw the rest of the grid afresh each run.


def random_config(rng: random.Random) -> dict:
    return dict(
        dtype=rng.choice([F32, F16]),
        d=rng.choice([64, 128]),
        group=rng.choice([1, 3, 8]),
        block_size=rng.choice([16, 32]),
        hkv=rng.choice([1, 2]),
    )


@pytest.mark.parametrize("draw", range(6))
def test_decode_random(rng: random.Random, draw: int) -> None:
    cfg = random_config(rng)
    batch = rng.randint(1, 16)
    lens = ragged_lens(rng, batch, rng.choice([rng.randint(1, 64), rng.randint(65, 2000)]), cfg["block_size"])
    splits = rng.choice([None, 1, 2, 5, 8])
    print(cfg, lens, splits)
    tables, num_blocks = block_tables_for(rng, lens, cfg["block_size"], extra_cols=rng.randint(0, 4))
    k_cache, v_cache = random_cache(num_blocks, cfg["block_size"], cfg["hkv"], cfg["d"], cfg["dtype"])
    q = torch.randn(batch, cfg["hkv"] * cfg["group"], cfg["d"]).to(cfg["dtype"])
    scale = 1 / math.sqrt(cfg["d"])
    out = paged_decode_attention(
        q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale, splits
    )
    assert_close(out, reference(q, k_cache, v_cache, tables, lens, [1] * batch, scale), cfg["dtype"])


@pytest.mark.parametrize("draw", range(6))
def test_prefill_random(rng: random.Random, draw: int) -> None:
    cfg = random_config(rng)
    batch = rng.randint(1, 6)
    qlens = [rng.choice([1, rng.randint(2, 80)]) for _ in range(batch)]
    prefix = [rng.choice([0, rng.randint(1, 300)]) for _ in range(batch)]
    if rng.random() < 0.3:
        prefix[0] = rng.randint(1000, 2000 - qlens[0])  # one long context
    lens = [p + m for p, m in zip(prefix, qlens, strict=True)]
    print(cfg, prefix, qlens)
    tables, num_blocks = block_tables_for(rng, lens, cfg["block_size"], extra_cols=rng.randint(0, 2))
    k_cache, v_cache = random_cache(num_blocks, cfg["block_size"], cfg["hkv"], cfg["d"], cfg["dtype"])
    q = torch.randn(sum(qlens), cfg["hkv"] * cfg["group"], cfg["d"]).to(cfg["dtype"])
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    scale = 1 / math.sqrt(cfg["d"])
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, max(qlens), scale)
    assert_close(out, reference(q, k_cache, v_cache, tables, lens, qlens, scale), cfg["dtype"])


# ---- int64 offsets --------------------------------------------------------------------------------


def test_offsets_past_int32(rng: random.Random) -> None:
    """A cache of more than 2**31 elements: blocks near its end are only reachable with int64 offsets.

    The caches are left uninitialised (torch.empty), so only the pages the test touches are ever
    backed by memory: a few MB resident out of 2 x 4 GiB reserved.
    """
    dtype, block_size, hkv, d, group = F16, 16, 1, 16, 4
    num_blocks = 2**31 // (block_size * hkv * d) + 64
    assert num_blocks * block_size * hkv * d > 2**31
    k_cache = torch.empty(num_blocks, block_size, hkv, d, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    lens = [rng.randint(40, 90), rng.randint(1, 30)]
    need = [cdiv(n, block_size) for n in lens]
    high = rng.sample(range(num_blocks - 64, num_blocks), sum(need) - 1)
    blocks = [rng.randrange(100), *high]  # one low block too: both ends of the cache in one table
    tables = torch.zeros(2, max(need), dtype=torch.int32)
    tables[0, : need[0]] = torch.tensor(blocks[: need[0]])
    tables[1, : need[1]] = torch.tensor(blocks[need[0] :])

    # Write every token through the kernel, then attend over them.
    slots = torch.cat(
        [
            (tables[b, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size)
            for b, n in enumerate(lens)
        ]
    )
    key = torch.randn(len(slots), hkv, d).to(dtype)
    value = torch.randn(len(slots), hkv, d).to(dtype)
    store_kvcache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, hkv, d)[slots], key)
    assert torch.equal(v_cache.view(-1, hkv, d)[slots], value)

    q = torch.randn(2, hkv * group, d).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = reference(q, k_cache, v_cache, tables, lens, [1, 1], 0.25)
    assert_close(paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, 2), ref, dtype)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert_close(paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, 1, 0.25), ref, dtype)


def test_head_offsets_past_int32_in_a_head_major_cache(rng: random.Random) -> None:
    """The engine's head-major cache layout (allocate_kv's) with three KV heads, each head's plane just over
    2**30 elements: head 2 starts past 2**31 although its stride fits in 32 bits, so ``kv_head * stride_h``
    must be computed in int64. The caches are uninitialised memory, so only the pages touched are ever
    backed (allocate_kv itself zeroes its cache on CPU: 13 GB resident here)."""
    from sluice.engine.attention import allocate_kv, head_major

    dtype, block_size, hkv, d, group = F16, 16, 3, 16, 2
    num_blocks = 2**30 // (block_size * d) + 64
    device = torch.device(TEST_DEVICE)
    k_cache, v_cache = (torch.empty(hkv, num_blocks, block_size, d, dtype=dtype, device=device).permute(1, 2, 0, 3)
                        for _ in range(2))
    small = allocate_kv(4, block_size, hkv, d, dtype, device)
    assert head_major(small).is_contiguous() and head_major(k_cache).is_contiguous()  # the same layout
    assert k_cache.stride(2) < 2**31 <= (hkv - 1) * k_cache.stride(2)
    lens = [rng.randint(20, 60), rng.randint(1, 20)]
    need = [cdiv(n, block_size) for n in lens]
    blocks = rng.sample(range(num_blocks - 64, num_blocks), sum(need))
    for cache in (k_cache, v_cache):  # the blocks read: zeroed, as the engine's cache is
        cache[torch.tensor(blocks)] = 0
    tables = torch.zeros(2, max(need), dtype=torch.int32)
    tables[0, : need[0]] = torch.tensor(blocks[: need[0]])
    tables[1, : need[1]] = torch.tensor(blocks[need[0] :])
    slots = torch.cat([tables[b, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                       for b, n in enumerate(lens)])
    key = torch.randn(len(slots), hkv, d).to(dtype)
    value = torch.randn(len(slots), hkv, d).to(dtype)
    store_kvcache(key, value, k_cache, v_cache, slots)
    where = (slots // block_size, slots % block_size)  # indexing picks rows; a reshape would copy 12 GB
    assert torch.equal(k_cache[where], key)
    assert torch.equal(v_cache[where], value)

    q = torch.randn(2, hkv * group, d).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    ref = reference(q, k_cache, v_cache, tables, lens, [1, 1], 0.25)
    assert_close(paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, 2), ref, dtype)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    assert_close(paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, 1, 0.25), ref, dtype)


# ---- the engine's backend ---------------------------------------------------------------------------


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode-step", "mixed-step"])
def test_triton_attention_backend(rng: random.Random, decode_only: bool) -> None:
    """TritonAttention writes the step's K/V and attends: a step over an empty cache, like the engine's."""
    dtype, block_size, hkv, group, d = F32, 16, 2, 2, 64
    batch = 4
    prefix = [rng.randint(0, 50) for _ in range(batch)]
    qlens = [1] * batch if decode_only else [rng.randint(1, 30) for _ in range(batch)]
    lens = [p + m for p, m in zip(prefix, qlens, strict=True)]
    tables, num_blocks = block_tables_for(rng, lens, block_size)
    k_cache, v_cache = random_cache(num_blocks, block_size, hkv, d, dtype)
    tokens = sum(qlens)
    q = torch.randn(tokens, hkv * group, d)
    k = torch.randn(tokens, hkv, d)
    v = torch.randn(tokens, hkv, d)
    slots = []
    for b, (p, n) in enumerate(zip(prefix, lens, strict=True)):
        pos = torch.arange(p, n)
        slots.append(tables[b, pos // block_size].long() * block_size + pos % block_size)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        slot_mapping=torch.cat(slots),
        block_tables=tables,
        max_query_len=max(qlens),
        max_seq_len=max(lens),
    )
    out = TritonAttention().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    assert torch.equal(k_cache.view(-1, hkv, d)[meta.slot_mapping], k)
    assert torch.equal(v_cache.view(-1, hkv, d)[meta.slot_mapping], v)
    assert_close(out, reference(q, k_cache, v_cache, tables, lens, qlens, 0.125), dtype)


def test_engine_with_triton_backend_matches_transformers(rng: random.Random, tiny_model_dir: Path) -> None:
    """The whole engine on the kernels (interpreted): greedy tokens as transformers', through chunked
    prefill (a small token budget splits the prompts), mixed steps and pure decode steps."""
    from helpers import assert_greedy_matches, hf_greedy, random_prompts
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(rng, 6, 1, 60)
    llm = LLM(
        str(tiny_model_dir),
        dtype="float32",
        attention_backend="triton",
        kv_cache_memory=16 << 20,
        max_num_batched_tokens=64,
    )
    reqs = [
        Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=12))
        for i, p in enumerate(prompts)
    ]
    for p, c in zip(prompts, llm.generate(reqs), strict=True):
        assert c.error is None
        assert_greedy_matches(hf, p, c.token_ids, hf_greedy(hf, p, 12))
