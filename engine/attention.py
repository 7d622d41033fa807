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

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from sluice.engine.huge_pages import zeros_huge
from sluice.engine.kv_quant import dequantize_rows, is_quantized, quantize_rows, row_width


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


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend declares about itself, so the model runner asks it rather than testing its type."""

    cuda_graphs: bool = False  # decode launches depend on shapes alone (no host sync): capturable
    reads_unwritten_slots: bool = True  # attends over slots not yet written: fresh blocks must be zeroed
    host_prepare: bool = False  # ``prepare(meta)`` groups the step on the host once per step (never captured)
    fused_kernels: str | None = None  # the elementwise kernels that go with it: "triton", "cpu" or None (eager)
    device_type: str | None = None  # the one device type it runs on; None = any


class AttentionBackend(Protocol):
    caps: BackendCapabilities

    def prepare(self, meta: AttentionMetadata) -> list[Any] | None:  # per-step host work; None where none
        ...

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
        sliding_window: int | None = None,  # a query at position p sees keys at positions > p - window
        logits_soft_cap: float | None = None,  # scores become cap * tanh(scores / cap) before masking
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


@dataclass(frozen=True)
class LayerKVSpec:
    """What one layer keeps per token in the cache: layers of one model may differ (Gemma 3n, OpenELM...)."""

    num_kv_heads: int
    head_dim: int


def allocate_kv(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """One layer's K (or V) cache: head-major memory, viewed as ``[num_blocks, block_size, Hkv, D]``; an int8
    cache's rows are ``D`` values and their scale (engine/kv_quant.py)."""
    shape = (num_kv_heads, num_blocks, block_size, row_width(head_dim, dtype))
    if device.type == "cpu":
        memory = zeros_huge(shape, dtype)  # read in scattered pages: spare the TLB; faulted in now
    else:
        memory = torch.empty(shape, dtype=dtype, device=device)
    return memory.permute(1, 2, 0, 3)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The memory of a cache from ``allocate_kv`` as it lies: ``[Hkv, num_blocks, block_size, D]``."""
    return cache.permute(2, 0, 1, 3)


@dataclass
class _Group:
    """Sequences attended together: queries padded to ``q_rows.shape[1]``, keys to whole blocks."""

    q_rows: torch.Tensor  # [B, Q] packed query row of each padded query (pads point at row 0)
    q_valid: torch.Tensor  # [B, Q] bool
    blocks: torch.Tensor  # [B * nb] the sequences' block ids, flattened
    mask: torch.Tensor  # [B, 1, Q, L] bool, True where a query may see a key
    q_pos: torch.Tensor  # [B, Q] absolute position of each padded query
    rows: torch.Tensor | None = None  # the same blocks as rows of every head's cache (built at first use)
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # per sliding window, built at first use

    def mask_for(self, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is None:
            return self.mask
        if sliding_window not in self.window_masks:
            kj = torch.arange(self.mask.shape[-1], device=self.mask.device)
            inside = kj[None, None, :] > self.q_pos[:, :, None] - sliding_window
            self.window_masks[sliding_window] = self.mask & inside[:, None]
        return self.window_masks[sliding_window]


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
    return _Group(q_rows, q_valid, blocks, mask[:, None], q_pos)


def _length_buckets(idx: torch.Tensor, seq_lens: torch.Tensor, min_size: int = 16,
                    max_ratio: float = 1.5) -> list[torch.Tensor]:
    """Split sequences, sorted by length, where the longest would exceed ``max_ratio`` times the
    shortest of its bucket; a bucket keeps at least ``min_size`` sequences (each costs a call per layer)."""
    lens, order = seq_lens[idx].sort()
    buckets, start = [], 0
    lens_list = lens.tolist()
    for i, n in enumerate(lens_list):
        if i - start >= min_size and n > max_ratio * lens_list[start] and len(lens_list) - i >= min_size:
            buckets.append(idx[order[start:i]])
            start = i
    buckets.append(idx[order[start:]])
    return buckets


class TorchAttention:
    """PyTorch attention for CPU, vectorised over the batch.

    Decodes (one query each) and prompt chunks are attended in separate groups, and decodes are
    bucketed by context length, so no sequence is padded far past its own length. Each group gathers
    its sequences' whole blocks once per layer (reading the KV cache is what a CPU decode step mostly
    spends its time on), and GQA is plain attention with the query heads of a KV head stacked.
    """

    caps = BackendCapabilities(host_prepare=True)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def prepare(self, meta: AttentionMetadata) -> list[_Group]:
        parts = []
        if meta.decode_idx is not None and meta.decode_idx.numel():
            parts += _length_buckets(meta.decode_idx, meta.seq_lens)
        if meta.prefill_idx is not None and meta.prefill_idx.numel():
            parts.append(meta.prefill_idx)
        return [_make_group(meta, idx, self.block_size) for idx in parts]

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        k_hm, v_hm = head_major(k_cache), head_major(v_cache)
        store_kv(k, v, k_hm, v_hm, meta.slot_mapping)
        out = torch.empty_like(q)
        groups = meta.groups if meta.groups is not None else self.prepare(meta)
        for g in groups:
            res = _attend_group(q, k_hm, v_hm, g, scale, g.mask_for(sliding_window), logits_soft_cap)
            out[g.q_rows[g.q_valid]] = res[g.q_valid]
        return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_hm: torch.Tensor, v_hm: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V ``[T, Hkv, D]`` into head-major caches at their slots (-1 = skip); quantized into an int8
    cache."""
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    if is_quantized(k_hm):
        k, v = quantize_rows(k), quantize_rows(v)
    h, d = k_hm.shape[0], k_hm.shape[-1]
    k_hm.view(h, -1, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_hm.view(h, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def _attend_group(q: torch.Tensor, k_hm: torch.Tensor, v_hm: torch.Tensor, g: _Group, scale: float,
                  mask: torch.Tensor, soft_cap: float | None) -> torch.Tensor:
    b, qm = g.q_rows.shape
    h_kv, d = k_hm.shape[0], q.shape[-1]
    group = q.shape[1] // h_kv
    lm = mask.shape[-1]
    # [B, Q, Hq, D] -> [B, Hkv, G*Q, D]: per KV head, each sequence's query heads side by side, so GQA is
    # plain attention with G*Q queries (the library's own GQA path is slow on CPU).
    qg = q[g.q_rows].view(b, qm, h_kv, group, d).permute(0, 2, 3, 1, 4).reshape(b, h_kv, group * qm, d)
    keys = _gather_blocks(k_hm, g, q.dtype).view(h_kv, b, lm, d).transpose(0, 1)
    vals = _gather_blocks(v_hm, g, q.dtype).view(h_kv, b, lm, d).transpose(0, 1)
    mask = mask if qm == 1 else mask.repeat(1, 1, group, 1)  # [B, 1, G*Q, L]
    if soft_cap is None:
        out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=scale)  # [B, Hkv, G*Q, D]
    else:  # SDPA has no soft-capping: the scores are capped by hand, in the order transformers' eager path uses
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale
        scores = torch.tanh(scores / soft_cap) * soft_cap
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        out = torch.matmul(probs, vals)
    return out.view(b, h_kv, group, qm, d).permute(0, 3, 1, 2, 4).reshape(b, qm, h_kv * group, d)


def _gather_blocks(cache_hm: torch.Tensor, g: _Group, dtype: torch.dtype) -> torch.Tensor:
    """Copy the group's blocks out of a head-major cache as ``[Hkv, B * nb, block_size, D]`` in ``dtype``
    (an int8 cache's dequantized).

    Seen as a 2-D table of whole (head, block) rows, this is one row gather, which runs at memcpy
    speed; selecting along the block dimension of the 4-D tensor was several times slower."""
    h, num_blocks = cache_hm.shape[0], cache_hm.shape[1]
    if g.rows is None:
        heads = torch.arange(h, device=g.blocks.device)[:, None] * num_blocks
        g.rows = (heads + g.blocks[None, :]).flatten()
    table = cache_hm.view(h * num_blocks, -1)
    rows = table.index_select(0, g.rows).view(h, g.blocks.numel(), *cache_hm.shape[2:])
    return dequantize_rows(rows, dtype) if is_quantized(cache_hm) else rows
