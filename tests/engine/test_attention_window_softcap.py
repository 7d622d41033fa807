"""Sliding windows and logit soft-capping in both attention backends, against kernels/reference.py in float64.

Each backend gets one packed step with fresh prompts, chunks after a cached prefix and decodes, all
longer than the window, with a window, a soft cap, both, and neither (the plain path unchanged).
The Triton kernels run under the interpreter (float32).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import fresh_seed
from sluice.engine.attention import AttentionMetadata, TorchAttention, allocate_kv
from sluice.engine.triton_attention import TritonAttention
from sluice.kernels.paged_attention import paged_decode_attention
from sluice.kernels.reference import paged_attention_reference, relative_error

BLOCK, HKV, GROUP, D = 16, 2, 3, 32
OPTIONS = [
    pytest.param(None, None, id="plain"),
    pytest.param(7, None, id="window7"),
    pytest.param(None, 2.0, id="softcap2"),
    pytest.param(20, 5.0, id="window20-softcap5"),
]


def _step(rng: random.Random, prefix: list[int], qlens: list[int]) -> tuple[AttentionMetadata, int]:
    lens = [p + m for p, m in zip(prefix, qlens, strict=True)]
    need = [-(-n // BLOCK) for n in lens]
    pool = list(range(sum(need) + 3))
    rng.shuffle(pool)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    slots = []
    for b, (p, n) in enumerate(zip(prefix, lens, strict=True)):
        tables[b, : need[b]] = torch.tensor(pool[: need[b]], dtype=torch.int32)
        del pool[: need[b]]
        pos = torch.arange(p, n)
        slots.append(tables[b, pos // BLOCK].long() * BLOCK + pos % BLOCK)
    q_lens = torch.tensor(qlens, dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.nn.functional.pad(q_lens.cumsum(0, dtype=torch.int32), (1, 0)),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        slot_mapping=torch.cat(slots),
        block_tables=tables,
        max_query_len=max(qlens),
        max_seq_len=max(lens),
        decode_idx=torch.nonzero(q_lens == 1).flatten(),
        prefill_idx=torch.nonzero(q_lens > 1).flatten(),
    )
    return meta, sum(need) + 3


def _check(backend: object, prefix: list[int], qlens: list[int], window: int | None, cap: float | None) -> None:
    rng = random.Random(fresh_seed())
    torch.manual_seed(rng.randrange(2**31))
    meta, num_blocks = _step(rng, prefix, qlens)
    k_cache, v_cache = (allocate_kv(num_blocks, BLOCK, HKV, D, torch.float32, torch.device("cpu")) for _ in range(2))
    k_cache.normal_(), v_cache.normal_()  # the cached prefixes
    t = sum(qlens)
    q, k, v = torch.randn(t, HKV * GROUP, D) * 2, torch.randn(t, HKV, D), torch.randn(t, HKV, D)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.3, sliding_window=window, logits_soft_cap=cap)
    ref = paged_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens.tolist(), qlens, 0.3,
                                    sliding_window=window, logits_soft_cap=cap)
    err = relative_error(out, ref)
    assert err <= 1e-5, f"relative error {err:.2e}"
    if window is not None or cap is not None:  # the option changed the result: it was not ignored
        plain = paged_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.seq_lens.tolist(), qlens, 0.3)
        assert relative_error(out, plain) > 1e-3


MIXED = ([0, 40, 0, 33, 5], [30, 12, 1, 1, 50])  # fresh prompt, chunk after a prefix, decodes, long prompt


@pytest.mark.parametrize("window,cap", OPTIONS)
def test_torch_attention_window_and_soft_cap(window: int | None, cap: float | None) -> None:
    _check(TorchAttention(BLOCK), *MIXED, window, cap)


@pytest.mark.parametrize("window,cap", OPTIONS)
def test_triton_prefill_window_and_soft_cap(window: int | None, cap: float | None) -> None:
    _check(TritonAttention(), *MIXED, window, cap)


@pytest.mark.parametrize("window,cap", OPTIONS)
def test_triton_decode_window_and_soft_cap(window: int | None, cap: float | None) -> None:
    _check(TritonAttention(), [0, 70, 9, 140], [1, 1, 1, 1], window, cap)


def test_triton_decode_window_across_splits() -> None:
    """Split-K decode with a window that leaves the early splits empty and cuts one split in the middle."""
    rng = random.Random(fresh_seed())
    torch.manual_seed(rng.randrange(2**31))
    lens = [300, 130, 5]
    meta, num_blocks = _step(rng, [n - 1 for n in lens], [1, 1, 1])
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK, HKV, D) for _ in range(2))
    q = torch.randn(3, HKV * GROUP, D)
    out = paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, 0.3, 4,
                                 sliding_window=100, logits_soft_cap=3.0)
    ref = paged_attention_reference(q, k_cache, v_cache, meta.block_tables, lens, [1, 1, 1], 0.3,
                                    sliding_window=100, logits_soft_cap=3.0)
    assert relative_error(out, ref) <= 1e-5
