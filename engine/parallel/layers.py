"""Tensor-parallel layers, and the sharding of a loaded native (Llama family) model across ranks.

Megatron's split: q/k/v and gate/up are column-parallel (each rank computes its own heads and its own
slice of the MLP's intermediate units, no communication), o and down are row-parallel (each rank's
partial product, summed by one all_reduce). The embedding and the LM head are split by vocabulary: an
id outside a rank's rows embeds as zeros there and the all_reduce adds the one rank's row to zeros,
exactly; the head's logits are all-gathered. Norms and rotary tables are replicated.

A model is sharded after it is loaded whole (every rank reads the full checkpoint, keeps its slices):
simple, and fine for models that fit a host's memory once per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sluice.engine.parallel.state import ParallelState
from torch import nn


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r^T) + b``: this rank's input columns; the bias is added once, after the sum."""

    def __init__(self, linear: nn.Linear, ps: ParallelState) -> None:
        super().__init__()
        cols = _split(linear.in_features, ps)
        self.linear = _linear(linear.weight[:, cols], None)  # an nn.Linear: engine/linear.py may repack it
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.group = ps.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding table; ids of other ranks' rows embed as zeros, summed over ranks."""

    def __init__(self, weight: torch.Tensor, ps: ParallelState) -> None:
        super().__init__()
        rows = _vocab_rows(weight.shape[0], ps)
        self.start, self.end = rows.start, rows.stop
        self.weight = nn.Parameter(weight.detach()[rows].clone(), requires_grad=False)
        self.group = ps.group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        out = out.masked_fill(~mine[:, None], 0)
        dist.all_reduce(out, group=self.group)
        return out


class VocabParallelHead(nn.Module):
    """This rank's rows of the LM head; every rank's logits all-gathered into the whole vocabulary."""

    def __init__(self, weight: torch.Tensor, ps: ParallelState) -> None:
        super().__init__()
        self.vocab_size = weight.shape[0]
        self.chunk = _vocab_chunk(self.vocab_size, ps.world_size)
        self.linear = _linear(weight.detach()[_vocab_rows(self.vocab_size, ps)], None)
        self.world_size, self.group = ps.world_size, ps.group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.linear(hidden)
        if local.shape[1] < self.chunk:  # the last rank's slice is short: all_gather needs equal shapes
            local = F.pad(local, (0, self.chunk - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


def check_divisible(config: Any, world_size: int, names: tuple[str, ...]) -> None:
    """Heads, KV heads and MLP units must split evenly; the message names what does not."""
    for name in names:
        n = getattr(config, name)
        if n % world_size:
            raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's {name} ({n})")


@torch.no_grad()
def shard_llama(net: Any, ps: ParallelState) -> None:
    """Keep this rank's shard of every layer of a loaded ``sluice.engine.models.llama.LlamaForCausalLM``, in place."""
    check_divisible(net.config, ps.world_size, ("num_attention_heads", "num_key_value_heads", "intermediate_size"))
    for layer in net.layers:
        _shard_attention(layer.self_attn, ps)
        _shard_mlp(layer.mlp, ps)
    head = net.lm_head.weight
    net.embed_tokens = VocabParallelEmbedding(net.embed_tokens.weight, ps)
    net.lm_head = VocabParallelHead(head, ps)


def _shard_attention(attn: Any, ps: ParallelState) -> None:
    w = ps.world_size
    q_rows, kv_rows = _split(attn.q_size, ps), _split(attn.kv_size, ps)
    rows = [q_rows, _shift(kv_rows, attn.q_size), _shift(kv_rows, attn.q_size + attn.kv_size)]
    attn.qkv_proj = _rows_of(attn.qkv_proj, rows)
    attn.o_proj = RowParallelLinear(attn.o_proj, ps)
    attn.num_heads, attn.num_kv_heads = attn.num_heads // w, attn.num_kv_heads // w
    attn.q_size, attn.kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim


def _shard_mlp(mlp: Any, ps: ParallelState) -> None:
    units = _split(mlp.intermediate, ps)
    mlp.gate_up_proj = _rows_of(mlp.gate_up_proj, [units, _shift(units, mlp.intermediate)])
    mlp.down_proj = RowParallelLinear(mlp.down_proj, ps)
    mlp.intermediate //= ps.world_size


def _split(n: int, ps: ParallelState) -> slice:
    size = n // ps.world_size
    return slice(ps.rank * size, (ps.rank + 1) * size)


def _shift(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


def _vocab_chunk(vocab: int, world_size: int) -> int:
    return -(-vocab // world_size)


def _vocab_rows(vocab: int, ps: ParallelState) -> slice:
    chunk = _vocab_chunk(vocab, ps.world_size)
    return slice(min(ps.rank * chunk, vocab), min((ps.rank + 1) * chunk, vocab))


def _rows_of(linear: nn.Linear, rows: list[slice]) -> nn.Linear:
    weight = torch.cat([linear.weight[r] for r in rows])
    bias = None if linear.bias is None else torch.cat([linear.bias[r] for r in rows])
    return _linear(weight, bias)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A plain ``nn.Linear`` owning copies of ``weight`` and ``bias`` (slices would keep the whole alive)."""
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return out
