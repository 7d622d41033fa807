"""Any decoder-only model transformers can load, run over Sluice's paged KV cache.

transformers' own modules do everything except attention (embeddings, norms, rotary variants, MoE
routing, logit scaling): Sluice's attention is registered through transformers' ``AttentionInterface``
as ``"sluice"``, and the step (packed tokens as one row, their positions, the ``AttentionMetadata``,
the caches and the backend) travels through the model's forward kwargs down to every attention call.
Each call writes the layer's new K/V into that layer's paged cache and attends from it, honouring the
layer's sliding window and soft-cap. No mask is built: the metadata says what each query sees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sluice.engine.attention import AttentionBackend, AttentionMetadata, LayerKVSpec
from sluice.engine.models.base import UnsupportedModelError
from sluice.engine.vision import StepImages, is_vision_config
from torch import nn

ATTN_IMPL = "sluice"
STEP_KWARG = "sluice_step"
# Attention features a layer may ask for that the paged cache and kernels cannot express yet.
_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks", "position_bias": "a position bias (ALiBi/T5-style)"}


@dataclass
class SluiceStep:
    """What every attention call of one forward needs; ``record`` set = a probe that only looks at shapes."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata | None
    backend: AttentionBackend | None
    record: dict[int, LayerKVSpec] | None = None


def sluice_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, softcap: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q/k/v ``[1, H, T, D]`` in, ``[1, T, Hq, D]`` out."""
    step: SluiceStep | None = kwargs.get(STEP_KWARG)
    name = type(module).__name__
    if step is None:
        raise UnsupportedModelError(f"{name} does not pass forward kwargs down to its attention")
    for arg, feature in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(arg) is not None:
            raise UnsupportedModelError(f"{name} uses {feature}, which Sluice's paged attention does not support")
    if attention_mask is not None:
        raise UnsupportedModelError(f"{name} builds its own attention mask, which Sluice's paged attention cannot apply")
    if not getattr(module, "is_causal", True):
        raise UnsupportedModelError(f"{name} is bidirectional; Sluice's paged attention is causal only")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise UnsupportedModelError(f"{name} has no layer_idx, so its KV cache cannot be found")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    if step.record is not None:
        step.record[layer] = LayerKVSpec(k.shape[1], k.shape[2])
        return torch.zeros_like(q)[None], None
    assert step.meta is not None and step.backend is not None
    k_cache, v_cache = step.kv_caches[layer]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.backend.forward(q, k, v, k_cache, v_cache, step.meta, scale,
                               sliding_window=sliding_window, logits_soft_cap=softcap)
    return out[None], None


def _register() -> None:
    from transformers import AttentionInterface

    # Not registered as a mask function on purpose: transformers then builds no mask for "sluice".
    AttentionInterface.register(ATTN_IMPL, sluice_attention)


class TransformersForCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind the same interface as the native models."""

    def __init__(self, hf: Any) -> None:
        super().__init__()
        _register()
        # A vision-language model: the decoder's attention only; the vision tower keeps transformers' own.
        hf.set_attn_implementation({"text_config": ATTN_IMPL} if is_vision_config(hf.config) else ATTN_IMPL)
        hf.config.use_cache = False
        self.hf = hf.eval()
        self.config = hf.config
        self.decoder = hf.get_decoder()
        self.lm_head = hf.get_output_embeddings()
        if self.lm_head is None:
            raise UnsupportedModelError(f"{type(hf).__name__} has no output embeddings (lm_head)")
        self._spec = self._probe()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend: AttentionBackend, images: StepImages | None = None) -> torch.Tensor:
        step = SluiceStep(kv_caches, meta, backend)
        return self._hidden(input_ids, positions, step, images)

    def _hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, step: SluiceStep,
                images: StepImages | None = None) -> torch.Tensor:
        # Packed tokens of every sequence are one batch row; attention alone keeps the sequences apart.
        if images is None:
            inputs: dict[str, torch.Tensor] = {"input_ids": input_ids[None]}
        else:  # a vision-language model's step: the image rows replace their placeholder tokens' embeddings
            embeds = self.decoder.get_input_embeddings()(input_ids)
            embeds[images.rows] = images.values.to(embeds.dtype)
            inputs = {"inputs_embeds": embeds[None]}
        # positions [T], or [3, T] (M-RoPE's t/h/w rows: engine/mrope.py), as transformers' [.., 1, T]
        position_ids = positions[:, None] if positions.dim() == 2 else positions[None]
        out = self.decoder(position_ids=position_ids, use_cache=False, **inputs, **{STEP_KWARG: step})
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head with the post-processing transformers' ``*ForCausalLM.forward`` applies, in float32."""
        logits = self.lm_head(hidden)
        cfg = self.config
        cap = getattr(cfg, "final_logit_softcapping", None)  # Gemma 2/3
        if cap:
            logits = torch.tanh(logits / cap) * cap
        divide = getattr(cfg, "logits_scaling", None)  # Granite
        if divide:
            logits = logits / divide
        multiply = getattr(cfg, "logit_scale", None)  # Cohere
        if isinstance(multiply, (int, float)) and not isinstance(multiply, bool):
            logits = logits * multiply
        return logits.float()

    def kv_spec(self) -> list[LayerKVSpec]:
        return self._spec

    @torch.inference_mode()
    def _probe(self) -> list[LayerKVSpec]:
        """Run three tokens with attention that only records each layer's K shape: proves that every
        layer's attention comes through here with the step, and that ``compute_logits`` reproduces
        transformers' own logits (an unknown logit post-processing is refused, not run wrongly)."""
        dev = self.lm_head.weight.device
        ids = torch.tensor([1, 2, 3], device=dev) % self.config.get_text_config().vocab_size
        pos = torch.arange(3, device=dev)
        record: dict[int, LayerKVSpec] = {}
        hidden = self._hidden(ids, pos, SluiceStep([], None, None, record))
        name = type(self.hf).__name__
        if not record:
            raise UnsupportedModelError(f"{name} does not route its attention through transformers' AttentionInterface")
        if sorted(record) != list(range(len(record))):
            raise UnsupportedModelError(f"{name} shares KV caches across layers, which Sluice's cache cannot express")
        ref = self.hf(input_ids=ids[None], position_ids=pos[None], use_cache=False,
                      **{STEP_KWARG: SluiceStep([], None, None, {})}).logits[0].float()
        ours = self.compute_logits(hidden)
        if not torch.allclose(ours, ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max())):
            raise UnsupportedModelError(f"{name} post-processes its logits in a way Sluice does not reproduce")
        return [record[i] for i in range(len(record))]


def build_transformers_model(hf: Any, device: torch.device, dtype: torch.dtype) -> TransformersForCausalLM:
    return TransformersForCausalLM(hf.to(device=device, dtype=dtype))
