"""Plain PyTorch references for the kernels, in float64: what the tests and bench/gpu_check.py check against."""

from __future__ import annotations

import torch


def gather_tokens(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` tokens of one sequence, ``[n, Hkv, D]`` in float64, read through its block table."""
    block_size = cache.shape[1]
    blocks = table[: -(-n // block_size)].long()
    return cache[blocks].reshape(-1, *cache.shape[2:])[:n].double()


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: list[int],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention for packed queries ``[T, Hq, D]``, in float64.

    Query ``j`` of sequence ``b`` (rows packed back to back) sits at position
    ``p = seq_lens[b] - query_lens[b] + j`` and sees the keys up to it (only those after
    ``p - sliding_window`` with a window); soft-capped scores are ``cap * tanh(scores / cap)``.
    """
    group = q.shape[1] // k_cache.shape[2]
    out, row = [], 0
    for b, (n, m) in enumerate(zip(seq_lens, query_lens, strict=True)):
        k = (
            gather_tokens(k_cache, block_tables[b], n).repeat_interleave(group, 1).transpose(0, 1)
        )  # [Hq, n, D]
        v = gather_tokens(v_cache, block_tables[b], n).repeat_interleave(group, 1).transpose(0, 1)
        qb = q[row : row + m].double().transpose(0, 1)  # [Hq, m, D]
        key_pos = torch.arange(n, device=q.device)[None, :]
        q_pos = torch.arange(n - m, n, device=q.device)[:, None]
        visible = key_pos <= q_pos
        if sliding_window is not None:
            visible &= key_pos > q_pos - sliding_window
        scores = qb @ k.transpose(-1, -2) * scale
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        o = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v
        out.append(o.transpose(0, 1))
        row += m
    return torch.cat(out)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude."""
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()
