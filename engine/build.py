"""Loading a model for the generation engine (engine/llm.py wires what this returns): the device and dtype,
the implementation and quantization, the weights (natively or through transformers), the tokenizer or a
vision model's processor, tensor parallelism, LoRA hooks, the CPU linear path, and the model runner."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, cast

import torch
from sluice.engine.config import EngineConfig
from sluice.engine.encoder_linear import fuse_vision_gelu
from sluice.engine.linear import use_cpu_linear
from sluice.engine.loader import (
    ModelSource,
    check_decoder_only,
    dense_path,
    load_config,
    load_hf_model,
    load_processor,
    load_tokenizer,
    resolve_model,
)
from sluice.engine.lora.adapters import require_peft
from sluice.engine.lora.manager import LoraManager
from sluice.engine.model_runner import ModelRunner
from sluice.engine.models.base import CausalLM, UnsupportedModelError
from sluice.engine.models.native_load import load_native
from sluice.engine.models.select import build_model
from sluice.engine.quant.checkpoint import read_weight_scales
from sluice.engine.quant.int8 import quantize_linears
from sluice.engine.quant.methods import QuantPlan, pick_impl, plan_quantization
from sluice.engine.startup_clock import StartupClock
from sluice.engine.vision import VisionEncoder, is_vision_config

log = logging.getLogger(__name__)


@dataclass
class Checkpoint:
    """What reading the checkpoint's config decided, before any weight loads."""

    src: ModelSource
    config: Any  # the checkpoint's transformers config
    device: torch.device
    dtype: torch.dtype
    model_impl: str  # native | transformers
    quant: QuantPlan


@dataclass
class LoadedModel:
    """A model ready to run and what was chosen loading it."""

    net: CausalLM
    device: torch.device
    dtype: torch.dtype
    model_impl: str
    quantization: str
    tokenizer: Any
    processor: Any  # a vision-language model's; else None
    hf_config: Any
    max_len: int  # the model's own limit, capped by max_model_len
    lora: LoraManager | None
    cpu_linear: str
    eos_ids: set[int]

    @property
    def text_config(self) -> Any:
        return self.hf_config.get_text_config()  # a vision-language model's decoder; else the config


def load_model(config: EngineConfig, clock: StartupClock) -> LoadedModel:
    """Everything that loads ``config.model``; ``clock`` times each phase for the start-up line."""
    if config.serves_lora:
        require_peft()  # before the model loads: one line now, not each adapter line failing later
    ck = read_checkpoint(config, clock)
    # The native model straight from the checkpoint where it can be (engine/models/native_load.py), else
    # built from transformers' loaded model.
    fast = ck.model_impl == "native" and ck.quant.load_config is None and config.tensor_parallel_size == 1
    hf = None if fast else load_hf_model(ck.src, ck.dtype, ck.quant.load_config)
    clock.lap("weights")
    processor = load_processor(ck.src) if is_vision_config(ck.config) else None
    tokenizer = load_tokenizer(ck.src, ck.config) if processor is None else processor.tokenizer
    clock.lap("tokenizer")
    hf_config = ck.config if hf is None else hf.config
    max_len = model_max_len(hf_config.get_text_config(), ck.model_impl, config.max_model_len)
    if config.tensor_parallel_size > 1:
        ck.device = _parallel_device(config, ck, hf_config, processor)
    net, hf = _build_net(ck, hf, hf_config, max_len)
    log.info("model %s: %s implementation (%s), quantization %s, %s", hf_config.model_type, ck.model_impl,
             "from transformers' model" if hf is not None else "loaded natively", ck.quant.name,
             parallelism(config.tensor_parallel_size, ck.device))
    del hf
    lora = _lora_manager(config, net, ck)  # before the linear layers are replaced: adapters' targets are read from them
    net = _finish_net(config, net, ck, hf_config, max_len)
    clock.lap("build")
    if processor is not None:
        fuse_vision_gelu(cast(torch.nn.Module, net), config.cpu_linear, ck.device, ck.dtype)
    cpu_linear = use_cpu_linear(cast(torch.nn.Module, net), config.cpu_linear, hf_config, ck.device, ck.dtype)
    clock.lap("gemm")
    return LoadedModel(net, ck.device, ck.dtype, ck.model_impl, ck.quant.name, tokenizer, processor, hf_config,
                       max_len, lora, cpu_linear, eos_ids(hf_config.get_text_config(), tokenizer, ck.src))


def read_checkpoint(config: EngineConfig, clock: StartupClock) -> Checkpoint:
    """The source, its config, and the device, dtype, implementation and quantization it will run with."""
    device = pick_device(config.device)
    src = resolve_model(config.model)  # once: every load reads this source
    checkpoint_config = load_config(src)
    check_decoder_only(checkpoint_config)  # before anything reads the config as a decoder's
    clock.lap("config")  # a GGUF model's first load dequantizes it here (engine/loader.py)
    dtype = pick_dtype(config.dtype, device, checkpoint_config.get_text_config(), config.cpu_linear)
    clock.lap("dtype")
    impl = pick_impl(checkpoint_config, config.quantization, config.model_impl)
    quant = plan_quantization(checkpoint_config, config.quantization, impl, device)
    return Checkpoint(src, checkpoint_config, device, dtype, impl, quant)


def build_runner(config: EngineConfig, m: LoadedModel, clock: StartupClock) -> ModelRunner:
    """The model runner over ``m`` (it loads the C++ ops), with its LoRA hooks and a vision model's encoder."""
    runner = ModelRunner(config, m.net, m.device, m.dtype, m.max_len)
    runner.lora = m.lora
    runner.vision = None if m.processor is None else VisionEncoder(cast(Any, m.net).hf, m.processor, config, m.device,
                                                                    m.dtype)
    if m.lora is not None:  # the C++ LoRA op is built and loaded with the C++ attention op
        m.lora.use_cpu_op = runner.kernels is not None and m.device.type == "cpu"
    clock.lap("ops")
    return runner


def parallelism(tensor_parallel_size: int, device: torch.device) -> str:
    """How the model is split, for the start-up line and the worker's heartbeat."""
    if tensor_parallel_size == 1:
        return "one device"
    return f"tensor parallel {tensor_parallel_size} ({'nccl' if device.type == 'cuda' else 'gloo'})"


def _parallel_device(config: EngineConfig, ck: Checkpoint, hf_config: Any, processor: Any) -> torch.device:
    """Rank 0's device, once what cannot be split is refused."""
    from sluice.engine.parallel.build import check_supported, driver_device

    if processor is not None:
        raise UnsupportedModelError("vision-language models run on one device for now (tensor_parallel_size 1)")
    check_supported(ck.model_impl, hf_config, config.tensor_parallel_size)
    return driver_device(ck.device)


def _build_net(ck: Checkpoint, hf: Any, hf_config: Any, max_len: int) -> tuple[CausalLM, Any]:
    """The model to run, and transformers' loaded model where it was built from one (else None)."""
    native = None if hf is not None else load_native(dense_path(ck.src), hf_config, max_len, ck.device, ck.dtype)
    if native is not None:
        return native, None
    if hf is None:  # the fast path did not cover this checkpoint (it logged why)
        hf = load_hf_model(ck.src, ck.dtype, ck.quant.load_config)
    return build_model(hf, ck.model_impl, max_len, ck.device, ck.dtype), hf


def _finish_net(config: EngineConfig, net: CausalLM, ck: Checkpoint, hf_config: Any, max_len: int) -> CausalLM:
    """``net`` with native int8 weights where asked for, and split over the ranks where asked for."""
    if ck.quant.native_int8:
        scales = read_weight_scales(dense_path(ck.src)) if ck.quant.checkpoint_scales else None
        count = quantize_linears(cast(torch.nn.Module, net), scales=scales)
        log.info("int8 weight-only: %d linear layers (%s scales)", count, "checkpoint" if scales else "absmax")
    if config.tensor_parallel_size == 1:
        return net
    from sluice.engine.parallel.build import start_tensor_parallel

    return cast(CausalLM, start_tensor_parallel(net, ck.src, config, hf_config, ck.model_impl, ck.dtype, ck.device,
                                                max_len))


def _lora_manager(c: EngineConfig, net: CausalLM, ck: Checkpoint) -> LoraManager | None:
    if not c.serves_lora:
        return None
    return LoraManager(cast(torch.nn.Module, net), ck.model_impl, c.lora_modules or {}, c.max_loras, c.max_lora_rank,
                       ck.device, ck.dtype, c.lora_roots or (), c.max_cpu_loras)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device, config: Any, cpu_linear: str) -> torch.dtype:
    if name != "auto":
        try:
            return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
        except KeyError:
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {name!r}") from None
    if device.type == "cuda":
        return torch.bfloat16
    from sluice.engine.cpu_dtype import pick_cpu_dtype

    dtype, why = pick_cpu_dtype(config, cpu_linear)
    log.info("dtype auto: %s on this CPU: %s", str(dtype).removeprefix("torch."), why)
    return dtype


def model_max_len(config: Any, impl: str, cap: int | None) -> int:
    """The model's own limit (capped at ``cap``, max_model_len, where given)."""
    n = getattr(config, "max_position_embeddings", None) or 4096
    window = getattr(config, "sliding_window", None)
    # The native path attends fully: cap at a sliding window so the model never sees past what it was trained on.
    n = min(n, window) if window and impl == "native" else n
    return n if cap is None else min(n, cap)


def eos_ids(config: Any, tokenizer: Any, src: ModelSource) -> set[int]:
    ids: set[int] = set()
    for v in (config.eos_token_id, tokenizer.eos_token_id, _generation_eos(src)):
        if isinstance(v, int):
            ids.add(v)
        elif v:
            ids.update(v)
    return ids


def _generation_eos(src: ModelSource) -> Any:
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(dense_path(src)).eos_token_id
    except (OSError, ValueError):
        return None
