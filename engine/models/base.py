"""What the model runner needs from a model, whichever path implements it (native or transformers)."""

from __future__ import annotations

from typing import Protocol

import torch
from sluice.engine.attention import AttentionBackend, AttentionMetadata, LayerKVSpec


class UnsupportedModelError(ValueError):
    """A model the engine cannot run; the message is one line that names the reason."""


class CausalLM(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                 backend: AttentionBackend) -> torch.Tensor:  # [T, hidden] final hidden states
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, vocab] float32
        ...

    def kv_spec(self) -> list[LayerKVSpec]:  # one entry per layer that has a KV cache
        ...
