"""Attention over the paged KV cache: split-K decode ("flash decoding") and packed varlen prefill.

Cache layout: ``[num_blocks, block_size, num_kv_heads, head_dim]``; token ``i`` of a sequence sits in
block ``block_table[i // block_size]`` at row ``i % block_size``. Both kernels gather a tile of
``BLOCK_N`` tokens through the block table, so the tile size does not depend on the cache's
block size. Cache offsets are int64: ``block * stride`` overflows int32 in a big cache.

Softmax runs in base 2 (``exp2`` with the scale folded into ``log2(e) * scale``), accumulating in
float32 whatever the input dtype.

An int8 cache (``--kv-cache-dtype int8``, engine/kv_quant.py: each row's int8 values then its float32
scale) is read as it lies: each tile's rows are widened and multiplied by their scales in registers.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
DECODE_BLOCK_N = 64  # tokens per decode tile
PREFILL_BLOCK_M = 64  # (query token, head) rows per prefill program
PREFILL_BLOCK_N = 64  # key tokens per prefill tile
MIN_TOKENS_PER_SPLIT = 256  # a shorter split costs more in its merge than it gains in parallelism
PROGRAMS_PER_SM = 4  # decode programs wanted per SM before splitting stops


@triton.jit
def _load_kv_tile(
    cache_ptr,
    bt_row_ptr,
    pos,
    pos_ok,
    kv_head,
    dims,
    dim_ok,
    stride_b,
    stride_s,
    stride_h,
    stride_d,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QUANT: tl.constexpr,  # int8 rows, their float32 scale after the HEAD_DIM values
):
    """Gather ``[len(pos), BLOCK_D]`` rows of one KV head through the block table (masked rows are 0);
    an int8 cache's dequantized, in float32."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    # int64 for the head too: in the head-major cache stride_h spans a whole layer's blocks, so
    # kv_head * stride_h passes 2**31 in a big cache even where each factor fits in 32 bits.
    row = block * stride_b + (pos % BLOCK_SIZE) * stride_s + kv_head.to(tl.int64) * stride_h
    ptrs = cache_ptr + row[:, None] + dims[None, :] * stride_d
    vals = tl.load(ptrs, mask=pos_ok[:, None] & dim_ok[None, :], other=0.0)
    if QUANT:
        scale_ptrs = (cache_ptr + row + HEAD_DIM * stride_d).to(tl.pointer_type(tl.float32), bitcast=True)
        scale = tl.load(scale_ptrs, mask=pos_ok, other=0.0)
        return vals.to(tl.float32) * scale[:, None]
    return vals


@triton.jit
def _scores(q, k, scale_log2, cap_log2, SOFT_CAP: tl.constexpr):
    """Scores in base 2; with SOFT_CAP, ``cap * tanh(s / cap)`` (tanh as 2 * sigmoid(2x) - 1: no libdevice)."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
    if SOFT_CAP:
        s = cap_log2 * (2.0 * tl.sigmoid(2.0 * s / cap_log2) - 1.0)
    return s


# Scalars that vary from step to step are not specialised (on == 1 or % 16), so that a long run does not
# keep compiling variants: they only feed address arithmetic, where the hints buy nothing.
@triton.jit(do_not_specialize=["min_split", "num_splits", "stride_bt"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    scale_log2,
    cap_log2,
    window,
    min_split,
    num_splits,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a dot-friendly size (>= 16)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,  # a single split: write the normalised output, no partials
    SOFT_CAP: tl.constexpr,
    SLIDING: tl.constexpr,  # only the last ``window`` positions are visible
    QUANT: tl.constexpr,  # an int8 cache
):
    """One (sequence, KV head, split): all GROUP query heads share each K/V tile that is loaded."""
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(seq_lens_ptr + b)
    lo = 0
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)  # only the last ``window`` positions are visible
    # Each sequence cuts its own visible range into num_splits parts of whole tiles, none shorter than
    # min_split: the split count is fixed per launch (a captured graph's table spans max_model_len), the
    # ranges follow the real context. Later splits of a short sequence are empty and weigh 0 in the merge.
    per_split = tl.maximum(tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N, min_split)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)  # end <= start: an empty split

    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    heads = kv_head * GROUP + g
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=g_ok[:, None] & dim_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b * stride_bt
    for tile in range(start, end, BLOCK_N):
        pos = tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        k = _load_kv_tile(
            k_cache_ptr, bt_row, pos, pos_ok, kv_head, dims, dim_ok,
            stride_kb, stride_ks, stride_kh, stride_kd, BLOCK_SIZE, HEAD_DIM, QUANT,
        ).to(q.dtype)  # fmt: skip
        v = _load_kv_tile(
            v_cache_ptr, bt_row, pos, pos_ok, kv_head, dims, dim_ok,
            stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_SIZE, HEAD_DIM, QUANT,
        ).to(q.dtype)  # fmt: skip
        s = _scores(q, k, scale_log2, cap_log2, SOFT_CAP)
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        # Every tile holds at least one valid token, so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    if DIRECT:
        # One split is the whole answer: normalise here and skip the merge kernel.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & dim_ok[None, :])
    else:
        # Partials are contiguous [B, Hq, num_splits] and [B, Hq, num_splits, HEAD_DIM].
        part = (b * num_q_heads + heads) * num_splits + split
        tl.store(m_part_ptr + part, m_i, mask=g_ok)
        tl.store(l_part_ptr + part, l_i, mask=g_ok)
        a_ptrs = acc_part_ptr + part[:, None] * HEAD_DIM + dims[None, :]
        tl.store(a_ptrs, acc, mask=g_ok[:, None] & dim_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    out_ptr,
    m_part_ptr,
    l_part_ptr,
    acc_part_ptr,
    num_splits,
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits rounded up to a power of two
):
    """Combine one (sequence, query head)'s split partials by log-sum-exp."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = b * tl.num_programs(1) + head
    splits = tl.arange(0, BLOCK_S)
    s_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM

    part = row * num_splits + splits
    m = tl.load(m_part_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(l_part_ptr + part, mask=s_ok, other=0.0)
    a_ptrs = acc_part_ptr + part[:, None] * HEAD_DIM + dims[None, :]
    acc = tl.load(a_ptrs, mask=s_ok[:, None] & dim_ok[None, :], other=0.0)

    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no tokens at all: avoid -inf - -inf
    w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
    denom = tl.sum(w * l_s, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)
    o_ptrs = out_ptr + b * stride_ob + head * stride_oh + dims * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    tile_starts_ptr,
    num_seqs,
    out_ptr,
    scale_log2,
    cap_log2,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    SLIDING: tl.constexpr,  # a query at position p sees keys at positions > p - window
    QUANT: tl.constexpr,  # an int8 cache
):
    """One (query tile of some sequence, KV head).

    The tile's rows are (query token, query head) pairs, GROUP heads per token, so the heads that
    share a KV head share every K/V tile loaded: short queries over a long context stay cheap.
    Tiles are numbered across the batch (``tile_starts[b]`` is sequence b's first), so a step with
    one long chunk and many decodes launches a program per real tile, not longest query x batch.
    """
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The sequence owning tile t: how many sequences start at or before it, counted 128 at a time.
    b = 0
    for c in range(0, num_seqs, 128):
        idx = c + tl.arange(0, 128)
        later = tl.load(tile_starts_ptr + 1 + idx, mask=idx < num_seqs, other=2**31 - 1)
        b += tl.sum((later <= t).to(tl.int32), 0)
    if b >= num_seqs:  # the grid is an upper bound on the tile count
        return
    tile = t - tl.load(tile_starts_ptr + b)

    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    tok0 = tile * TOKENS
    if tok0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - q_len  # tokens before this step's first query

    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_ok = (r < TOKENS * GROUP) & (tok < q_len)
    q_pos = ctx_len + tok  # absolute position: causal bound per row
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q_ptrs = q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Keys up to the tile's last query position, inclusive.
    kv_end = ctx_len + tl.minimum(tok0 + TOKENS, q_len)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(ctx_len + tok0 - window + 1, 0)  # the tile's first query sees no further back
    for kv_tile in range(kv_start, kv_end, BLOCK_N):
        pos = kv_tile + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        k = _load_kv_tile(
            k_cache_ptr, bt_row, pos, pos_ok, kv_head, dims, dim_ok,
            stride_kb, stride_ks, stride_kh, stride_kd, BLOCK_SIZE, HEAD_DIM, QUANT,
        ).to(q.dtype)  # fmt: skip
        v = _load_kv_tile(
            v_cache_ptr, bt_row, pos, pos_ok, kv_head, dims, dim_ok,
            stride_vb, stride_vs, stride_vh, stride_vd, BLOCK_SIZE, HEAD_DIM, QUANT,
        ).to(q.dtype)  # fmt: skip
        s = _scores(q, k, scale_log2, cap_log2, SOFT_CAP)
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row with nothing visible yet keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough programs for about PROGRAMS_PER_SM per SM, with no split shorter than MIN_TOKENS_PER_SPLIT.

    A decode program holds ~80-120 registers a thread and 20-40 KB of shared memory, so an SM runs
    about 5-6 at once: fewer resident programs leave bandwidth unused. (A guess until measured:
    bench/gpu_check.py sweeps the split count next to this choice.)
    """
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132  # an H100/H200 otherwise
    target = PROGRAMS_PER_SM * sms
    programs = batch * num_kv_heads
    if programs >= target:
        return 1
    return max(1, min(triton.cdiv(target, programs), max_context // MIN_TOKENS_PER_SPLIT, 64))


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """Return (GROUP, block_size) after checking that q and the caches agree."""
    num_q_heads, head_dim = q.shape[1:]
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4, (k_cache.shape, v_cache.shape)
    num_kv_heads = k_cache.shape[2]
    quant = k_cache.dtype == torch.int8  # rows of head_dim values and a 4-byte scale (engine/kv_quant.py)
    assert k_cache.shape[3] == head_dim + (4 if quant else 0), (k_cache.shape, q.shape)
    assert num_q_heads % num_kv_heads == 0, (num_q_heads, num_kv_heads)
    assert v_cache.dtype == k_cache.dtype and (quant or q.dtype == k_cache.dtype), (q.dtype, k_cache.dtype, v_cache.dtype)
    return num_q_heads // num_kv_heads, k_cache.shape[1]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence, ``q [B, Hq, D]``, over its first ``seq_lens[b]`` cached tokens.

    The split count comes from the block table's capacity (no host sync on ``seq_lens``); each sequence
    then cuts its own context into that many ranges of whole tiles, at least MIN_TOKENS_PER_SPLIT long
    where the count was chosen here (an explicit ``num_splits`` is honoured down to one tile a split);
    ranges past a sequence's end are empty and weigh nothing in the merge.
    """
    batch, num_q_heads, head_dim = q.shape
    group, block_size = _check_cache(q, k_cache, v_cache)
    num_kv_heads = k_cache.shape[2]
    assert block_tables.shape[0] == batch and seq_lens.shape == (batch,), (block_tables.shape, seq_lens.shape)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    min_split = DECODE_BLOCK_N
    if num_splits is None:
        num_splits = pick_num_splits(batch, num_kv_heads, max_context, q.device)
        min_split = MIN_TOKENS_PER_SPLIT
    assert num_splits >= 1, num_splits
    block_d = triton.next_power_of_2(head_dim)
    if num_splits == 1:
        m_part = l_part = acc_part = out  # unused: the kernel writes `out` directly
    else:
        f32 = dict(device=q.device, dtype=torch.float32)
        m_part = torch.empty(batch, num_q_heads, num_splits, **f32)
        l_part = torch.empty(batch, num_q_heads, num_splits, **f32)
        acc_part = torch.empty(batch, num_q_heads, num_splits, head_dim, **f32)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        m_part,
        l_part,
        acc_part,
        scale * LOG2E,
        (logits_soft_cap or 1.0) * LOG2E,
        sliding_window or 0,
        min_split,
        num_splits,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=DECODE_BLOCK_N,
        DIRECT=num_splits == 1,
        SOFT_CAP=logits_soft_cap is not None,
        SLIDING=sliding_window is not None,
        QUANT=k_cache.dtype == torch.int8,
        num_warps=4,
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_q_heads)](
            out,
            m_part,
            l_part,
            acc_part,
            num_splits,
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention for packed queries ``q [T, Hq, D]``, every key read from the cache.

    Sequence ``b`` owns rows ``query_start_loc[b]:query_start_loc[b + 1]``: its last ``query_len``
    positions out of ``seq_lens[b]``, so a cached prefix or an earlier prefill chunk is attended to.
    """
    group, block_size = _check_cache(q, k_cache, v_cache)
    batch = seq_lens.shape[0]
    assert query_start_loc.shape == (batch + 1,), (query_start_loc.shape, batch)
    out = torch.empty_like(q)
    if batch == 0 or max_query_len == 0:
        return out
    head_dim = q.shape[2]
    block_m = max(PREFILL_BLOCK_M, triton.next_power_of_2(group))
    # Head dim 256 (Gemma): a [64, 256] float32 accumulator over 4 warps left ptxas at 255 registers with a
    # stack frame (kernels/aot.py reports it); 8 warps and half-width key tiles keep it in registers.
    block_n, num_warps = (PREFILL_BLOCK_N // 2, 8) if head_dim > 128 else (PREFILL_BLOCK_N, 4)
    tokens = block_m // group
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    tile_starts = torch.nn.functional.pad(torch.cumsum((q_lens + tokens - 1) // tokens, 0), (1, 0)).int()
    # sum(cdiv(q_len, tokens)) < cdiv(total, tokens) + batch: a bound known without a device sync.
    grid = (triton.cdiv(q.shape[0], tokens) + batch, k_cache.shape[2])
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        tile_starts,
        batch,
        out,
        scale * LOG2E,
        (logits_soft_cap or 1.0) * LOG2E,
        sliding_window or 0,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        SOFT_CAP=logits_soft_cap is not None,
        SLIDING=sliding_window is not None,
        QUANT=k_cache.dtype == torch.int8,
        num_warps=num_warps,
    )
    return out
