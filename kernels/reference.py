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
) -> torch.Tensor:
    """Causal attention for packed queries ``[T, Hq, D]``, in float64.

    Query ``j`` of sequence ``b`` (rows packed back to back) sits at position
    ``seq_lens[b] - query_lens[b] + j`` and sees the keys up to it.
    """
    group = q.shape[1] // k_cache.shape[2]
    out, row = [], 0
    for b, (n, m) in enumerate(zip(seq_lens, query_lens, strict=True)):
        k = (
            gather_tokens(k_cache, block_tables[b], n).repeat_interleave(group, 1).transpose(0, 1)
        )  # [Hq, n, D]
        v = gather_tokens(v_cache, block_tables[b], n).repeat_interleave(group, 1).transpose(0, 1)
        qb = q[row : row + m].double().transpose(0, 1)  # [Hq, m, D]
        visible = (
            torch.arange(n, device=q.device)[None, :] <= torch.arange(n - m, n, device=q.device)[:, None]
        )
        o = torch.nn.functional.scaled_dot_product_attention(qb, k, v, attn_mask=visible, scale=scale)
        out.append(o.transpose(0, 1))
        row += m
    return torch.cat(out)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude."""
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()
