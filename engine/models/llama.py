"""Llama-family decoder over packed tokens (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2).

No padding: the step's tokens from all sequences are one ``[T]`` row, with their positions and cache
slots in the explicit ``AttentionMetadata``. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from sluice.engine.attention import AttentionBackend, AttentionMetadata, LayerKVSpec
from torch import nn


class RMSNorm(nn.Module):
    """With ``residual``, normalise ``x + residual`` and return it too (the next residual stream)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels: ModuleType | None = None  # fused kernels (see use_fused_kernels): one op for add + norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if self.kernels is not None and x.dim() == 2:  # Qwen3's per-head q/k norms ([T, H, D] views) stay eager
            return self.kernels.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same order of operations as transformers, so float32 results agree bit for bit.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin tables for every position, from transformers' own rope initialisers (llama3 scaling etc.)."""

    def __init__(self, config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        rope = _rope_parameters(config)
        rope_type = rope.get("rope_type", "default")
        if rope_type == "default":
            base = rope["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic rope scaling depends on the sequence length; not supported")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        # rotate_half(x) * sin == roll(x, D/2) * sin_signed exactly: IEEE negation commutes with rounding.
        half = head_dim // 2
        self.register_buffer("sin_signed", torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1),
                             persistent=False)
        self.kernels: ModuleType | None = None  # a fused kernel rotating q and k in place

    def rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's cos and signed-sin rows ``[T, 1, D]``, looked up once for every layer (None on the
        fused path, whose kernel reads the tables by position)."""
        if self.kernels is not None:
            return None
        return self.cos[positions].to(dtype)[:, None, :], self.sin_signed[positions].to(dtype)[:, None, :]

    def forward(self, positions: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor] | None,
                qk: torch.Tensor, num_q_heads: int) -> torch.Tensor:
        """Rotate ``qk`` ``[T, Hq + Hkv, D]`` (query heads, then key heads), in one go."""
        if self.kernels is not None:
            self.kernels.apply_rotary(positions, qk[:, :num_q_heads], qk[:, num_q_heads:], self.cos, self.sin)
            return qk
        assert rows is not None
        cos, sin_signed = rows
        return qk * cos + qk.roll(qk.shape[-1] // 2, dims=-1) * sin_signed


def _rope_parameters(config: Any) -> dict[str, Any]:
    rope = getattr(config, "rope_parameters", None)
    if rope is None:  # older transformers: rope_theta and rope_scaling
        rope = dict(getattr(config, "rope_scaling", None) or {})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    return rope


class Attention(nn.Module):
    def __init__(self, config: Any, head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        # Qwen3: RMSNorm over each head's q and k, before rotary.
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary,
                rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k heads side by side as one [T, Hq + Hkv, D] view: one rotary pass rotates both.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        qk = rotary(positions, rope, qk, self.num_heads)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(out.reshape(t, self.q_size))


MLP_MIN_ROWS = 256  # fewer rows per GEMM than this cost more in GEMM efficiency than the cache saves


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.kernels: ModuleType | None = None  # a fused kernel for SiLU(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            rows = self._block_rows(x)
            if rows < x.shape[0]:
                return torch.cat([self._fused(x[i : i + rows]) for i in range(0, x.shape[0], rows)])
            return self._fused(x)
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        assert self.kernels is not None
        return self.down_proj(self.kernels.silu_and_mul(self.gate_up_proj(x)))

    def _block_rows(self, x: torch.Tensor) -> int:
        """Rows per pass: a long prompt step's ``[T, 2I]`` intermediate would spill out of the last-level
        cache between the two GEMMs and SiLU (kernels/cpu_fused.py's MLP_BLOCK_BYTES); the rows of a pass
        are computed exactly as in a whole one. Not under a LoRA hook, which indexes the step's rows."""
        budget = getattr(self.kernels, "MLP_BLOCK_BYTES", None)
        if budget is None or self.gate_up_proj._forward_hooks or self.down_proj._forward_hooks:
            return x.shape[0]
        return max(MLP_MIN_ROWS, budget // (2 * self.intermediate * x.element_size()))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, head_dim: int, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = Attention(config, head_dim, qkv_bias, o_bias, qk_norm)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rotary: Rotary,
                rope: tuple[torch.Tensor, torch.Tensor] | None, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (MLP output, residual stream); the next norm adds them, so the add and norm fuse."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, rope, kv_cache, meta, backend)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED:
            raise ValueError(f"model type {config.model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
        self.config = config
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Qwen2 has biases on q/k/v only; Llama's attention_bias covers q/k/v and o.
        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        qk_norm = config.model_type == "qwen3"
        self.layers = nn.ModuleList(DecoderLayer(config, self.head_dim, qkv_bias, o_bias, qk_norm)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config, self.head_dim, max_positions)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.rows(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, positions, self.rotary, rope, kv_cache, meta, backend)
        return self.norm(x, residual)[0]

    def use_fused_kernels(self, kernels: ModuleType | None) -> None:
        """RMSNorm (+ residual), rotary and SiLU * up through ``kernels``: kernels/fused.py (Triton: CUDA, or
        the interpreter) or kernels/cpu_fused.py (C++ CPU ops); None: eager PyTorch."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.kernels = kernels
        self.rotary.kernels = kernels if kernels is not None and kernels.rotary_supports(self.head_dim) else None

    def kv_spec(self) -> list[LayerKVSpec]:
        # Each layer's own KV head count: under tensor parallelism, this rank's share (engine/parallel/).
        return [LayerKVSpec(layer.self_attn.num_kv_heads, self.head_dim) for layer in self.layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # Reduce in float32: argmax and softmax over bfloat16 logits are slow on CPU and lose ties.
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy transformers' weights in, fusing q/k/v and gate/up."""
        self.load_weights(state.items())

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], take: bool = False) -> dict[str, int]:
        """Copy weights named as in a transformers checkpoint in (converting dtype and device), fusing q/k/v
        and gate/up; returns how many elements each own parameter received. ``take``: the tensors are the
        caller's to give away, so a whole parameter of the right dtype and device becomes that tensor, uncopied.
        A name with no place here raises KeyError, a shape that does not fit RuntimeError."""
        own = dict(self.named_parameters())
        filled: dict[str, int] = {}
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, offset = self._target(name)
            dest = own[target]
            part = dest[offset : offset + tensor.shape[0]] if target != name else dest
            if part.shape != tensor.shape:
                raise RuntimeError(f"{name}: shape {tuple(tensor.shape)} does not fit {tuple(part.shape)}")
            if take and target == name and tensor.dtype == dest.dtype and tensor.device == dest.device:
                dest.data = tensor  # the Parameter object stays: a tied one stays tied
            else:
                part.copy_(tensor)
            filled[target] = filled.get(target, 0) + tensor.numel()
        return filled

    def _target(self, name: str) -> tuple[str, int]:
        """Where a checkpoint weight goes: the own parameter's name and the row it starts at."""
        proj = name.split(".")[-2] if name.count(".") >= 2 else ""
        if ".self_attn." in name and proj in ("q_proj", "k_proj", "v_proj"):
            attn = self.layers[int(name.split(".")[1])].self_attn
            offset = {"q_proj": 0, "k_proj": attn.q_size, "v_proj": attn.q_size + attn.kv_size}[proj]
            return name.replace(proj, "qkv_proj"), offset
        if proj in ("gate_proj", "up_proj"):
            mlp = self.layers[int(name.split(".")[1])].mlp
            return name.replace(proj, "gate_up_proj"), 0 if proj == "gate_proj" else mlp.intermediate
        return name, 0


def build_model(config: Any, max_positions: int, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """An uninitialised model on ``device``: random init of weights that are about to be overwritten takes
    seconds, and building on the meta device instead costs a first-use import of sympy (most of a second)."""
    with torch.device(device), _without_random_init():
        net = LlamaForCausalLM(config, max_positions)
    for module in net.modules():  # fresh empty storage in ``dtype``: .to(dtype) would read and convert garbage
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=p.requires_grad))
    if config.tie_word_embeddings:
        net.lm_head.weight = net.embed_tokens.weight
    return net  # the rotary tables (buffers, not parameters) stay as built: float32 on ``device``


@contextlib.contextmanager
def _without_random_init() -> Iterator[None]:
    """nn.Linear and nn.Embedding keep ``torch.empty``'s memory as it is. Class-wide while it lasts (the way
    transformers' own no_init_weights works): only for building a model whose weights are loaded next."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = _no_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def _no_init(module: nn.Module) -> None:
    return None
