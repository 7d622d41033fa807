"""How many bytes a loaded model's weights hold, as stored: int8 data and its scales for a quantized
layer, a packed copy where a CPU GEMM made one. What the KV sizing takes away from a memory budget."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def _leaves(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The plain tensors behind ``t``: a tensor subclass (torchao's quantized weights) is flattened into
    the inner tensors that really hold its data."""
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        for name in names:
            yield from _leaves(getattr(t, name))
    else:
        yield t


def _module_tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module._parameters.values()  # type: ignore[misc]  # None entries are skipped below
    yield from module._buffers.values()  # type: ignore[misc]
    # Unregistered tensors: engine/linear.py's packed weights are plain attributes.
    yield from (v for v in vars(module).values() if isinstance(v, torch.Tensor))


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter, buffer and tensor attribute of ``model``'s modules, each storage once
    (a tied head and embedding count once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for module in model.modules():
        for t in _module_tensors(module):
            if t is None:
                continue
            for leaf in _leaves(t):
                nbytes = leaf.numel() * leaf.element_size()
                key = (_address(leaf), nbytes)
                if key not in seen:
                    seen.add(key)
                    total += nbytes
    return total


def _address(t: torch.Tensor) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:  # opaque layouts (an mkldnn tensor) have no data pointer to share
        return id(t)
