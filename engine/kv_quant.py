"""The 8-bit KV cache (``--kv-cache-dtype int8``): how a key or value row is stored, and the PyTorch
reference of its quantization.

A row (one token of one KV head) is ``head_dim`` int8 values followed by its scale, a float32 in the
row's last ``SCALE_BYTES`` bytes: the cache is an int8 tensor ``[..., head_dim + SCALE_BYTES]``, in the
same layout as a 16-bit cache (engine/attention.py), so everything that handles blocks (the block
manager, prefix caching, preemption, zeroing fresh blocks, tensor parallelism's per-rank caches) is
unchanged, and a zeroed row reads back as zeros.

One scale per token and head, symmetric (``scale = max|x| / 127``, ``q = round(x / scale)``): appending a
token never re-quantizes the rest of its block, and a row's error is at most half a step of its own
largest value. A scale per block and head would save 4 bytes a row but would have to grow, and so
re-round the block's earlier rows, whenever a token larger than them arrives. The bytes per row are
``head_dim + 4`` against ``2 * head_dim`` in 16 bits: 1.88x the blocks for a head dim of 64, 1.94x at 128.

Alternatives measured on SmolLM2-135M's real K/V (bench/kv_int8_attention_error.py, float64 attention; the
mean output error over each output row's largest value): this scheme 1.6%, of which the keys' part is most
(values alone 0.45%, keys alone 1.5%: score errors are scaled by the query's norm, then sharpened by the
softmax); a per-head key offset (channel mean) 1.6%; per-channel key smoothing folded into the projections
1.4-1.7%; asymmetric rows (min and zero point, 4 more bytes) 1.2%. None is a clear win for its cost, so the
rows stay symmetric; keeping keys in 16 bits (values only in int8) is what would remove most of the error.

The kernels quantize the same way (float32 division, round half to even), so their writes equal
``quantize_rows`` to the bit: kernels/cpu/store_kv.cpp, kernels/kv_write.py.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # a float32 scale after each row's int8 values
QMAX = 127.0  # symmetric: -127..127 (never -128, so the range is the same both sides)


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """What the cache tensors hold: the model's dtype (``auto``) or int8 (``int8``, and ``fp8``: other engines'
    name for an 8-bit cache; with a scale per token, int8's 255 even steps lose less than e4m3's 3-bit mantissa)."""
    return torch.int8 if kv_cache_dtype in ("int8", "fp8") else model_dtype


def is_quantized(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements in one cache row (one token of one KV head)."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The head dim a cache stores, whatever its dtype (its last dim counts the scale when int8)."""
    return cache.shape[-1] - SCALE_BYTES if is_quantized(cache) else cache.shape[-1]


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows ``[..., D]`` (any float dtype) as int8 rows ``[..., D + SCALE_BYTES]``: values then scale."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / QMAX
    # An all-zero row keeps scale 0 and values 0 (dividing by 1 instead of 0).
    q = torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 rows ``[..., D + SCALE_BYTES]`` back to ``[..., D]`` in ``dtype`` (computed in float32)."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :d].float() * scale).to(dtype)
