"""This process's place in a tensor-parallel group: its rank, the world size and the two groups.

The model's collectives (all_reduce, all_gather, broadcast of hidden rows) run on ``group``: NCCL on
CUDA, gloo on CPU. Each step's metadata travels as pickled objects on ``cpu_group`` (always gloo), so
CUDA tensors are never pickled and a rank waiting for the next step waits on the host. That wait has no
practical timeout (rank 0 may idle for hours between batches); a dead peer is noticed by the watchdogs
in engine/parallel/worker_procs.py instead.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# A collective inside a step waits at most this long for the other ranks.
STEP_TIMEOUT = timedelta(minutes=10)
# Between steps the other ranks wait for rank 0's next message for as long as it idles.
IDLE_TIMEOUT = timedelta(days=3650)


@dataclass
class ParallelState:
    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl"
    group: dist.ProcessGroup  # the model's collectives
    cpu_group: dist.ProcessGroup  # each step's metadata (gloo)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """One CUDA device per rank (rank r on cuda:r); on CPU every rank is on the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", rank)


def init(rank: int, world_size: int, init_method: str, device: torch.device) -> ParallelState:
    """Join the group (blocks until every rank has joined). One group per process: a previous one is gone."""
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=STEP_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    group = dist.group.WORLD
    assert group is not None
    log.debug("rank %d of %d joined (%s)", rank, world_size, backend)
    return ParallelState(rank, world_size, backend, group, cpu_group)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
