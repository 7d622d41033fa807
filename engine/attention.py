"""Attention over the paged KV cache: the step's metadata and the backends that consume it.

Cache layout (one decision shared by the block manager, the CPU path and the Triton kernels):
per layer, ``k_cache`` and ``v_cache`` are indexed ``[num_blocks, block_size, num_kv_heads, head_dim]``;
token ``i`` of a sequence lives in slot ``block_table[i // block_size] * block_size + i % block_size``.
The memory behind them is head-major, ``[num_kv_heads, num_blocks, block_size, head_dim]`` (see
``allocate_kv``): gathering a sequence's blocks then yields each head's keys as one contiguous
``[L, head_dim]`` matrix, which on CPU makes attention several times faster. Kernels take strides,
so they read either layout.

Every backend first writes the step's new K/V into their slots, then attends from the cache, so
a request can reuse prefix blocks that another request in the same step is filling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

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
    groups: list[Any] | None = None  # set by the backend's ``prepare`` once per step

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


def allocate_kv(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """One layer's K (or V) cache: head-major memory, viewed as ``[num_blocks, block_size, Hkv, D]``."""
    return torch.empty(num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device).permute(1, 2, 0, 3)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The memory of a cache from ``allocate_kv`` as it lies: ``[Hkv, num_blocks, block_size, D]``."""
    return cache.permute(2, 0, 1, 3)


@dataclass
class _Group:
    """Sequences attended together: queries padded to ``q_rows.shape[1]``, keys to whole blocks."""

    q_rows: torch.Tensor  # [B, Q] packed query row of each padded query (pads point at row 0)
    q_valid: torch.Tensor  # [B, Q] bool
    blocks: torch.Tensor  # [B * nb] the sequences' block ids, flattened
    mask: torch.Tensor  # [1, B, 1, Q, L] bool, True where a query may see a key


def _make_group(meta: AttentionMetadata, idx: torch.Tensor, block_size: int) -> _Group:
    dev = meta.seq_lens.device
    qsl = meta.query_start_loc.long()
    seq_lens = meta.seq_lens[idx].long()
    starts = qsl[idx]
    q_lens = qsl[idx + 1] - starts
    q_max, l_max = int(q_lens.max()), int(seq_lens.max())
    nb = -(-l_max // block_size)
    qi = torch.arange(q_max, device=dev)
    q_valid = qi[None, :] < q_lens[:, None]
    q_rows = torch.where(q_valid, starts[:, None] + qi[None, :], 0)
    kj = torch.arange(nb * block_size, device=dev)
    # Query i of a sequence sits at position seq_len - q_len + i and sees keys up to that position.
    q_pos = (seq_lens - q_lens)[:, None] + qi[None, :]
    mask = (kj[None, None, :] <= q_pos[:, :, None]) & (kj[None, None, :] < seq_lens[:, None, None])
    blocks = meta.block_tables[idx][:, :nb].long().flatten()
    return _Group(q_rows, q_valid, blocks, mask[None, :, None])


class TorchAttention:
    """PyTorch attention for CPU, vectorised over the batch.

    Decodes (one query each) and prompt chunks are attended as two groups, so a long prompt chunk does
    not pad every decode to its length. Each group gathers its sequences' whole blocks once per layer,
    and GQA is a grouped matmul: the query heads that share a KV head are stacked, which on CPU is far
    faster than expanding K/V or the library's GQA path.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(self, meta: AttentionMetadata) -> list[_Group]:
        return [_make_group(meta, idx, self.block_size) for idx in (meta.decode_idx, meta.prefill_idx)
                if idx is not None and idx.numel()]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_hm, v_hm = head_major(k_cache), head_major(v_cache)
        store_kv(k, v, k_hm, v_hm, meta.slot_mapping)
        out = torch.empty_like(q)
        groups = meta.groups if meta.groups is not None else self.prepare(meta)
        for g in groups:
            res = _attend_group(q, k_hm, v_hm, g, scale)
            out[g.q_rows[g.q_valid]] = res[g.q_valid]
        return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_hm: torch.Tensor, v_hm: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V ``[T, Hkv, D]`` into head-major caches at their slots (-1 = skip)."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    h, d = k_hm.shape[0], k_hm.shape[-1]
    k_hm.view(h, -1, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_hm.view(h, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def _attend_group(q: torch.Tensor, k_hm: torch.Tensor, v_hm: torch.Tensor, g: _Group, scale: float) -> torch.Tensor:
    b, qm = g.q_rows.shape
    h_kv, d = k_hm.shape[0], k_hm.shape[-1]
    group = q.shape[1] // h_kv
    lm = g.mask.shape[-1]
    # [B, Q, Hq, D] -> [Hkv, B, G*Q, D]: per KV head, each sequence's query heads side by side.
    qg = q[g.q_rows].view(b, qm, h_kv, group, d).permute(2, 0, 3, 1, 4).reshape(h_kv, b, group * qm, d)
    keys = k_hm.index_select(1, g.blocks).view(h_kv, b, lm, d)
    vals = v_hm.index_select(1, g.blocks).view(h_kv, b, lm, d)
    scores = torch.matmul(qg, keys.transpose(2, 3)).view(h_kv, b, group, qm, lm).float() * scale
    scores.masked_fill_(~g.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(h_kv, b, group * qm, lm)
    out = torch.matmul(probs, vals)  # [Hkv, B, G*Q, D]
    return out.view(h_kv, b, group, qm, d).permute(1, 3, 0, 2, 4).reshape(b, qm, h_kv * group, d)
