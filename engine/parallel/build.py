"""Building a tensor-parallel model: rank 0 from the engine's loaded model, the other ranks from the source."""

from __future__ import annotations

from typing import Any

import torch

from engine.config import EngineConfig
from engine.linear import pick_cpu_linear, use_cpu_linear
from engine.loader import ModelSource, load_hf_model
from engine.models.select import build_model, pick_model_impl
from engine.parallel.layers import check_divisible, shard_llama
from engine.parallel.state import ParallelState, rank_device
from engine.parallel.worker_procs import DriverModel, start


def check_supported(impl: str, hf_config: Any, world_size: int) -> None:
    """Refuse, before any rank starts, what cannot be split: the message is one line."""
    if impl != "native":
        raise ValueError("tensor_parallel_size > 1 runs the native (Llama family) implementation only; "
                         f"this model runs on the {impl} path")
    check_divisible(hf_config, world_size)


def driver_device(device: torch.device) -> torch.device:
    return rank_device(device, 0)


def start_tensor_parallel(net: Any, src: ModelSource, config: EngineConfig, hf_config: Any, impl: str,
                          dtype: torch.dtype, device: torch.device, max_model_len: int) -> DriverModel:
    """Rank 0's side: start the other ranks, keep rank 0's shard of ``net``; returns the model to run."""
    check_supported(impl, hf_config, config.tensor_parallel_size)
    cpu_linear, _ = pick_cpu_linear(config.cpu_linear, hf_config, device, dtype)  # every rank runs rank 0's choice
    return start(net, shard_llama, src.path, src.gguf_file, config, cpu_linear, dtype, device, max_model_len)


def build_shard(src: ModelSource, config: EngineConfig, dtype: torch.dtype, device: torch.device, max_model_len: int,
                ps: ParallelState) -> Any:
    """Ranks 1..N-1: load the model whole, as rank 0 did, and keep this rank's shard."""
    hf = load_hf_model(src, dtype)
    impl = pick_model_impl(hf.config, config.model_impl)
    check_supported(impl, hf.config, ps.world_size)
    net = build_model(hf, impl, max_model_len, device, dtype)
    shard_llama(net, ps)
    use_cpu_linear(net, config.cpu_linear, hf.config, device, dtype)
    return net
