"""Attention on the CPU by a C++ op that reads K/V blocks in place (``kernels/cpu/paged_attention.cpp``).

Same interface as ``TorchAttention``, which stays as the fallback where the op cannot be built. The
PyTorch path copies every sequence's blocks out of the cache once per layer before attending; at a
batch of a hundred and more that copy, not the model's matmuls, was most of a decode step.
"""

from __future__ import annotations

import torch
from sluice.engine.attention import AttentionMetadata, BackendCapabilities, head_major


def describe(dtype: torch.dtype, head_dims: set[int]) -> str:
    """Which kernels this model's attention runs and on what instructions, for the start-up log: the
    benchmarks' reports and a user's "is it on AMX?" read it there."""
    from sluice.kernels.cpu_ops import MIN_GEMM_ROWS, attention_isa, attention_kernel

    parts = []
    for d in sorted(head_dims):
        if attention_kernel(dtype, d) == "gemm":
            parts.append(f"head dim {d}: prompt tiles of {MIN_GEMM_ROWS}+ rows as oneDNN brgemm GEMMs on "
                         f"{attention_isa(dtype, d)}, decodes on the vector kernel")
        else:
            parts.append(f"head dim {d}: the vector kernel on {attention_isa(dtype, d)}")
    return "; ".join(parts)


class CpuPagedAttention:
    """Write the step's K/V into the paged cache, then attend from it in place, decodes and prompt
    chunks alike, in one call per layer."""

    # The op reads only positions up to each query's own, all written before it attends: fresh blocks
    # need no zeroing. Its C++ elementwise ops (and argmax) are built with it.
    caps = BackendCapabilities(reads_unwritten_slots=False, fused_kernels="cpu", device_type="cpu")

    def prepare(self, meta: AttentionMetadata) -> None:
        return None

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        from sluice.kernels.cpu_ops import paged_attention, store_kv

        k_hm, v_hm = head_major(k_cache), head_major(v_cache)
        store_kv(k, v, k_hm, v_hm, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype)
        return paged_attention(out, q, k_hm, v_hm, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                               sliding_window, logits_soft_cap)
