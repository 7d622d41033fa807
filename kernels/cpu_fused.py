"""The decoder layer's elementwise work as C++ CPU ops (``kernels/cpu/fused.cpp``): residual add + RMSNorm,
rotary embedding in place, SiLU(gate) * up. The same functions, with the same arguments, as the Triton
kernels in ``kernels/fused.py``, so the model takes either set; and greedy sampling's argmax
(``kernels/cpu/argmax.cpp``) and sampling's top-k and block sums of exp (``kernels/cpu/sampling.cpp``). Built and loaded with the attention op (``kernels/cpu_ops.py``)."""

from __future__ import annotations

import torch
from sluice.kernels.cpu_ops import load

# The MLP runs a long prompt step's rows in passes of this many bytes of [rows, 2I] intermediate
# (engine/models/llama.py): at 4,096 rows SmolLM2's is 50 MB, past a 32 MB L3, and the gate/up GEMM ran
# at half its speed at 1,024 rows (one thread, CPU time, 2-core EPYC: the MLP over 4,096 rows 129 ms
# whole, 105 ms in passes of 1,024 or 2,048, bit-identical).
MLP_BLOCK_BYTES = 16 << 20


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x [T, H]``; with ``residual``, normalise ``h = x + residual`` and
    return ``(normed, h)``, where ``h`` is the residual stream for the next layer."""
    out = torch.empty_like(x)
    if residual is None:
        load().rms_norm(out, x, weight, eps)
        return out
    h = torch.empty_like(x)
    load().add_rms_norm(out, h, x, residual, weight, eps)
    return out, h


def rotary_supports(head_dim: int) -> bool:
    return head_dim % 2 == 0


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place (views into a fused QKV are fine) by the
    rows ``positions [T]`` of the float32 tables ``cos``/``sin`` ``[max_positions, D]``; returns (q, k)."""
    load().rotary(q, k, positions, cos, sin)
    return q, k


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]`` for ``gate_up [T, 2I]``."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    load().silu_and_mul(out, gate_up)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row of float32 ``logits [N, V]`` (NaN counts as the largest), as
    ``logits.max(dim=-1).indices`` picks it, in one pass."""
    return load().argmax_rows(logits)


def topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of each row of float32 ``logits [N, V]`` and their ids, in descending order (of
    equal values the lower id first), as ``logits.topk(k)`` in one read of each row."""
    return load().topk_rows(logits, k)


def exp_block_sums(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, block: int) -> torch.Tensor:
    """[N, ceil(V / block)] float64 sums of ``exp((logits - shift) * inv_t)`` over blocks of ``block``
    columns (``shift``, ``inv_t`` [N] float32), without the [N, V] temporary."""
    return load().exp_block_sums(logits, shift, inv_t, block)
