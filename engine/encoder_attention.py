"""An encoder's attention on the CPU without padding: the C++ op ``kernels/cpu/encoder_attention.cpp``,
plugged into transformers' attention interface under the name ``sluice_encoder``.

The pooling runner hands the model a right-padded batch with each input's length
(engine/pooling_runner.py). PyTorch's SDPA reads that as a mask and still scores every padded key; the
op attends over each sequence's own keys, reads q/k/v through their strides (no transposed copies), and
writes the [B, S, H, D] layout the output projection takes as is. On all-MiniLM-L6-v2 shapes it ran
1.4-2.7x faster than SDPA (bench/encoder_attention_micro.py, a loaded 2-core EPYC).

The lengths reach the attention function through a context variable set around the forward pass, so no
model's ``forward`` has to pass a new argument. Everything the op does not do (a causal or sliding-window
model, GQA, dropout, soft-capping, a dtype other than float32, a forward pass without lengths) goes to
transformers' SDPA function unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

log = logging.getLogger(__name__)

NAME = "sluice_encoder"
CPU_ATTENTION = ("auto", "sdpa", "varlen")
_LENGTHS: ContextVar[torch.Tensor | None] = ContextVar("sluice_encoder_lengths", default=None)
_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "position_bias", "s_aux")


@contextmanager
def sequence_lengths(lengths: torch.Tensor) -> Iterator[None]:
    """Within this block, attention treats batch row ``b`` as its first ``lengths[b]`` tokens."""
    token = _LENGTHS.set(lengths.to(torch.long).contiguous())
    try:
        yield
    finally:
        _LENGTHS.reset(token)


def _op_fits(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             lengths: torch.Tensor | None, dropout: float, is_causal: bool | None, kwargs: dict[str, Any]) -> bool:
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    return (lengths is not None and not causal and dropout == 0.0 and query.device.type == "cpu"
            and query.dtype == torch.float32 and key.shape == query.shape and value.shape == query.shape
            and lengths.shape == query.shape[:1] and all(kwargs.get(k) is None for k in _UNSUPPORTED_KWARGS)
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1)


def encoder_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``query``/``key``/``value`` [B, H, S, D] -> [B, S, H, D]."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    lengths = _LENGTHS.get()
    if not _op_fits(module, query, key, value, lengths, dropout, is_causal, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    from sluice.kernels.cpu_ops import encoder_attention

    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    out = torch.empty(q.shape, dtype=q.dtype)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    encoder_attention(out, q, k, v, lengths, scale)  # type: ignore[arg-type]  # _op_fits checked it
    return out, None


def register() -> None:
    """Make ``attn_implementation="sluice_encoder"`` known to transformers (masks built as for SDPA)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, encoder_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def pick_attention(requested: str, config: Any, device: torch.device, dtype: torch.dtype) -> str:
    """The ``attn_implementation`` to load an embedding model with: ``sluice_encoder`` where the op runs
    (an encoder on the CPU in float32 whose head size the build supports), else ``sdpa``."""
    if requested not in CPU_ATTENTION:
        raise ValueError(f"cpu_attention must be one of {CPU_ATTENTION}, not {requested!r}")
    if requested == "sdpa":
        return "sdpa"
    why = _why_not(config, device, dtype)
    if why:
        if requested == "varlen":
            raise ValueError(f"cpu_attention varlen: {why}")
        log.info("attention: sdpa (%s)", why)
        return "sdpa"
    register()
    log.info("attention: %s (C++ variable-length, no padding)", NAME)
    return NAME


def _why_not(config: Any, device: torch.device, dtype: torch.dtype) -> str:
    if device.type != "cpu" or dtype != torch.float32:
        return f"the op runs float32 on the CPU, not {dtype} on {device.type}"
    if getattr(config, "is_decoder", False) or not hasattr(config, "num_attention_heads"):
        return "not an encoder"
    from sluice.kernels import cpu_ops

    ok, why = cpu_ops.available()
    if not ok:
        return f"the C++ op does not build here: {why}"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if not cpu_ops.encoder_attention_supports(int(head_dim)):
        return f"head_dim {head_dim} is not supported by this build"
    return ""
