"""Attention on the GPU with the Triton kernels in ``kernels/``: same interface as ``TorchAttention``.

The kernels are imported on first use, so importing the engine never needs triton.
"""

from __future__ import annotations

import torch
from sluice.engine.attention import AttentionMetadata, BackendCapabilities


class TritonAttention:
    """Write the step's K/V into the paged cache, then attend from it.

    A step of decodes only (every query length 1) takes the split-K decode kernel; any step with a
    longer query takes the varlen prefill kernel, which handles the decodes in it too.
    """

    # Decode launches depend on shapes alone (no host sync), so a decode step can be a CUDA graph; every
    # load is masked to the context's written slots, so fresh cache blocks need no zeroing. On CPU the
    # kernels run under the interpreter (tests) and the eager PyTorch elementwise ops go with them.
    caps = BackendCapabilities(cuda_graphs=True, reads_unwritten_slots=False, fused_kernels="triton")

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
        from sluice.kernels.kv_write import store_kvcache
        from sluice.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        extra = dict(sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        if meta.max_query_len != 1:
            return paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                meta.max_query_len,
                scale,
                **extra,
            )
        # Decode splits the context by the block table's width: trim it to this step's longest sequence.
        width = -(-meta.max_seq_len // k_cache.shape[1])
        tables = meta.block_tables[:, :width]
        num_seqs = meta.num_seqs
        if q.shape[0] == num_seqs:
            return paged_decode_attention(q, k_cache, v_cache, tables, meta.seq_lens, scale, **extra)
        # Rows past the last sequence (padding) belong to no sequence: leave them zero.
        out = torch.zeros_like(q)
        out[:num_seqs] = paged_decode_attention(q[:num_seqs], k_cache, v_cache, tables, meta.seq_lens, scale, **extra)
        return out
