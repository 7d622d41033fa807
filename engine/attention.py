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


@dataclass
class _Group:
    """Sequences attended together: their queries padded to ``q_rows.shape[1]``, keys to ``slots.shape[1]``."""

    q_rows: torch.Tensor  # [B, Q] packed query row of each padded query (pads point at row 0)
    q_valid: torch.Tensor  # [B, Q] bool
    slots: torch.Tensor  # [B, L] cache slot of each key position
    mask: torch.Tensor  # [B, 1, 1, Q, L] bool, True where a query may see a key


def _make_group(meta: AttentionMetadata, idx: torch.Tensor, block_size: int) -> _Group:
    qsl = meta.query_start_loc.long()
    seq_lens = meta.seq_lens[idx].long()
    starts = qsl[idx]
    q_lens = qsl[idx + 1] - starts
    q_max, l_max = int(q_lens.max()), int(seq_lens.max())
    qi = torch.arange(q_max)
    q_valid = qi[None, :] < q_lens[:, None]
    q_rows = torch.where(q_valid, starts[:, None] + qi[None, :], 0)
    kj = torch.arange(l_max)
    blocks = meta.block_tables[idx][:, kj // block_size].long()
    slots = blocks * block_size + kj % block_size
    # Query i of a sequence sits at position seq_len - q_len + i and sees keys up to that position.
    q_pos = (seq_lens - q_lens)[:, None] + qi[None, :]
    mask = (kj[None, None, :] <= q_pos[:, :, None]) & (kj[None, None, :] < seq_lens[:, None, None])
    return _Group(q_rows, q_valid, slots, mask[:, None, None])


class TorchAttention:
    """PyTorch attention for CPU, vectorised over the batch.

    Decodes (one query each) and prompt chunks are attended as two groups, so a long prompt chunk does
    not pad every decode to its length. K/V are gathered through the block tables with one index per
    step (built once, in ``prepare``), and GQA is a grouped matmul: the query heads that share a KV head
    are stacked, which on CPU is far faster than expanding K/V or the library's GQA path.
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
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        store_kv(k, v, k_flat, v_flat, meta.slot_mapping)
        out = torch.empty_like(q)
        groups = meta.groups if meta.groups is not None else self.prepare(meta)
        for g in groups:
            res = _attend_group(q, k_flat, v_flat, g, scale)
            out[g.q_rows[g.q_valid]] = res[g.q_valid]
        return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_flat.index_copy_(0, slot_mapping, k)
    v_flat.index_copy_(0, slot_mapping, v)


def _attend_group(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, g: _Group, scale: float) -> torch.Tensor:
    b, qm = g.q_rows.shape
    lm = g.slots.shape[1]
    h_kv, d = k_flat.shape[1], k_flat.shape[2]
    group = q.shape[1] // h_kv
    # [B, Q, Hq, D] -> [B, Hkv, G*Q, D]: the query heads of one KV head side by side.
    qg = q[g.q_rows].view(b, qm, h_kv, group, d).permute(0, 2, 3, 1, 4).reshape(b, h_kv, group * qm, d)
    keys = k_flat[g.slots].view(b, lm, h_kv, d).transpose(1, 2)  # [B, Hkv, L, D]
    vals = v_flat[g.slots].view(b, lm, h_kv, d).transpose(1, 2)
    scores = torch.matmul(qg, keys.transpose(2, 3)).view(b, h_kv, group, qm, lm).float() * scale
    scores.masked_fill_(~g.mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(b, h_kv, group * qm, lm)
    out = torch.matmul(probs, vals)  # [B, Hkv, G*Q, D]
    return out.view(b, h_kv, group, qm, d).permute(0, 3, 1, 2, 4).reshape(b, qm, h_kv * group, d)
