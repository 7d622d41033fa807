"""Building a tensor-parallel model: rank 0 from the engine's loaded model, the other ranks from the source.

Native path: the model is loaded whole and sharded by engine/parallel/layers.py. Transformers path:
transformers' own tensor parallelism (``from_pretrained`` with ``tp_plan="auto"``: the model's declared
``base_model_tp_plan``, DTensor on the group this process joined), loaded by every rank at once.
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import torch
from sluice.engine.config import EngineConfig
from sluice.engine.linear import pick_cpu_linear, use_cpu_linear
from sluice.engine.loader import ModelSource, dense_path, load_config, load_hf_model
from sluice.engine.models.select import build_model, pick_model_impl
from sluice.engine.parallel.layers import check_divisible, shard_llama
from sluice.engine.parallel.state import ParallelState, rank_device
from sluice.engine.parallel.worker_procs import DriverModel, start
from torch import nn

log = logging.getLogger(__name__)


def check_supported(impl: str, hf_config: Any, world_size: int) -> None:
    """Refuse, before any rank starts, what cannot be split: the message is one line."""
    if impl == "native":
        check_divisible(hf_config, world_size, ("num_attention_heads", "num_key_value_heads", "intermediate_size"))
        return
    text = hf_config.get_text_config()
    if not getattr(text, "base_model_tp_plan", None):
        raise ValueError(f"{hf_config.model_type} declares no tensor-parallel plan (base_model_tp_plan) in "
                         "transformers: it runs on one rank only")
    check_divisible(text, world_size, ("num_attention_heads", "num_key_value_heads"))


def driver_device(device: torch.device) -> torch.device:
    return rank_device(device, 0)


def start_tensor_parallel(net: Any, src: ModelSource, config: EngineConfig, hf_config: Any, impl: str,
                          dtype: torch.dtype, device: torch.device, max_model_len: int) -> DriverModel:
    """Rank 0's side: start the other ranks, keep rank 0's shard of ``net``; returns the model to run."""
    check_supported(impl, hf_config, config.tensor_parallel_size)
    if impl == "transformers" and config.cpu_linear != "aten":
        # transformers' parallel layers are nn.Linear with DTensor weights and hooks: not to be repacked.
        log.info("tensor parallel on the transformers path: cpu_linear aten (was %s)", config.cpu_linear)
        config.cpu_linear = "aten"
    cpu_linear, _ = pick_cpu_linear(config.cpu_linear, hf_config, device, dtype)  # every rank runs rank 0's choice

    def shard(net: nn.Module, ps: ParallelState) -> nn.Module:
        return shard_native(net, ps) if impl == "native" else load_transformers_shard(src, dtype, device, ps)

    return start(net, shard, src.path, src.gguf_file, config, cpu_linear, dtype, device, max_model_len)


def shard_native(net: nn.Module, ps: ParallelState) -> nn.Module:
    shard_llama(net, ps)
    return net


def load_transformers_shard(src: ModelSource, dtype: torch.dtype, device: torch.device, ps: ParallelState) -> nn.Module:
    """This rank's shard by transformers' own plan; every rank must call this at the same time (the load and
    the model wrapper's probe forward are collective)."""
    from sluice.engine.models.transformers_model import build_transformers_model
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    # transformers sizes its mesh from these variables, not from the group: unset, rank 0 would make a
    # mesh of one and never meet the others.
    ours = {"RANK": str(ps.rank), "LOCAL_RANK": str(ps.rank), "WORLD_SIZE": str(ps.world_size)}
    before = {k: os.environ.get(k) for k in ours}
    os.environ.update(ours)
    try:
        plan = DistributedConfig(tp_size=ps.world_size, tp_plan="auto")
        hf = AutoModelForCausalLM.from_pretrained(dense_path(src), dtype=dtype, distributed_config=plan)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return build_transformers_model(hf, device, dtype)


def build_shard(src: ModelSource, config: EngineConfig, dtype: torch.dtype, device: torch.device, max_model_len: int,
                ps: ParallelState) -> Any:
    """Ranks 1..N-1: build this rank's shard the way rank 0 built its own."""
    hf_config = load_config(src)
    impl = pick_model_impl(hf_config, config.model_impl)
    check_supported(impl, hf_config, ps.world_size)
    if impl == "transformers":
        return load_transformers_shard(src, dtype, device, ps)
    hf = load_hf_model(src, dtype)
    net = cast(nn.Module, build_model(hf, impl, max_model_len, device, dtype))
    shard_llama(net, ps)
    use_cpu_linear(net, config.cpu_linear, hf.config, device, dtype)
    return net
