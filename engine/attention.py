"""Attention over the paged KV cache: the step's metadata and the backends that consume it.

Cache layout (one decision shared by the block manager, the CPU path and the Triton kernels):
per layer, ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Token ``i`` of a sequence lives in slot ``block_table[i // block_size] * block_size + i % block_size``,
so a flat view ``[num_blocks * block_size, num_kv_heads, head_dim]`` is indexed by slot.

Every backend first writes the step's new K/V into their slots, then attends from the cache, so
a request can reuse prefix blocks that another request in the same step is filling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Everything attention needs about one packed step; built once per step, shared by all layers.

    Sequences are packed back to back with no padding: sequence ``b`` owns query rows
    ``query_start_loc[b]:query_start_loc[b + 1]``, which are its last ``query_len`` tokens out of
    ``seq_lens[b]`` (cached plus new).
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int32, context length after this step (cached + new)
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new token; -1 = skip
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each sequence's end
    max_query_len: int
    max_seq_len: int
    # CPU path only: precomputed once per step so that no layer repeats it.
    decode_idx: torch.Tensor | None = None  # sequences with query_len == 1
    prefill_idx: torch.Tensor | None = None  # sequences with query_len > 1

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
