"""Rank 0 starts ranks 1..N-1 as processes of their own, then drives them one message per model call.

Rank 0 (the engine's process) owns the scheduler and sampling. Its model is ``DriverModel``: each call
the model runner makes (allocate the KV cache, a forward, the LM head) is first broadcast as a small
message on the gloo ``cpu_group`` (input ids, positions and attention metadata on the host; the hidden
rows for the head go as a tensor broadcast on the model's group), then run on rank 0's own shard; the
other ranks run the same call on theirs, so every collective inside the model meets its partners.

Dying: a rank that exits (killed, crashed) takes the whole worker down at once, as a kill -9 of the
worker would: rank 0's watchdog thread sees the exit, stops the other ranks and exits the process
(a collective waiting on a dead rank cannot be interrupted from Python); the queue hands the jobs it
held to another worker or its restart. So does a rank that dies before it joined the group (rank 0
would wait in the rendezvous for good). A rank whose parent (rank 0) is gone exits too.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import faulthandler
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from sluice.engine.attention import AttentionBackend, AttentionMetadata, LayerKVSpec
from sluice.engine.config import EngineConfig, from_json
from sluice.engine.parallel import state
from sluice.engine.parallel.state import ParallelState
from torch import nn

log = logging.getLogger(__name__)

EXIT_RANK_DIED = 70  # the worker's exit status when a rank died under it
READY_TIMEOUT_S = 600.0  # loading the model on every rank
_ROOT = str(Path(__file__).resolve().parents[2])


@dataclass
class RankSpec:
    """What a rank needs to build its shard the way rank 0 built its own (JSON on the command line)."""

    model_path: str
    gguf_file: str | None
    config: dict[str, Any]  # EngineConfig's fields, cpu_linear resolved to rank 0's choice
    dtype: str
    device: str
    max_model_len: int
    world_size: int
    init_method: str
    parent_pid: int
    num_threads: int


# ---- rank 0 ---------------------------------------------------------------------------------------
class RankProcesses:
    """Ranks 1..N-1 as subprocesses, and the watchdog that ends the worker when one dies."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.told: dict[int, str] = {}  # a rank's line read while rank 0 joined (it had died meanwhile)
        self.stopping = False
        for rank in range(1, spec.world_size):
            cmd = [sys.executable, "-m", "sluice.engine.parallel.worker_procs", str(rank), json.dumps(dataclasses.asdict(spec))]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
            self.procs[rank] = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
            log.info("tensor parallel: rank %d is pid %d", rank, self.procs[rank].pid)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Each rank prints one line once its shard is loaded: "ready", or the error that stopped it."""
        deadline = time.monotonic() + timeout
        for rank, p in self.procs.items():
            assert p.stdout is not None
            line = self.told.get(rank)
            if line is None:
                left = deadline - time.monotonic()
                if not select.select([p.stdout], [], [], max(left, 0))[0]:
                    raise RuntimeError(f"tensor-parallel rank {rank} did not load the model within {timeout:.0f}s")
                line = p.stdout.readline().decode().strip()
            if line != "ready":
                p.wait(timeout=30)
                why = line.removeprefix("error: ") or f"it exited with status {p.returncode}"
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {why}")

    def watch(self, interval: float = 0.2) -> None:
        threading.Thread(target=self._watch, args=(interval,), name="tp-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def watch_joining(self, interval: float = 0.2) -> Iterator[None]:
        """While rank 0 joins the group: a rank that died before joining would leave rank 0 in the rendezvous
        for good (it cannot be interrupted from Python; the metadata group's waits have no practical timeout),
        so its death ends the worker, as a death does later. A rank that joined says so before it dies: its
        line ("ready", or the error that stopped its load) is kept for wait_ready to report."""
        joined = threading.Event()

        def watch() -> None:
            while not joined.wait(interval):
                for rank, p in self.procs.items():
                    if p.poll() is not None and rank not in self.told:
                        assert p.stdout is not None
                        self.told[rank] = p.stdout.readline().decode().strip()  # "" at EOF: it said nothing
                if "" in self.told.values() and not joined.is_set():
                    self._exit_if_one_died()

        watcher = threading.Thread(target=watch, name="tp-join-watchdog", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            joined.set()
            watcher.join()  # its reads of a dead rank's line are done before wait_ready reads the others

    def _watch(self, interval: float) -> None:
        while not self.stopping:
            self._exit_if_one_died()
            time.sleep(interval)

    def exit_if_a_rank_died(self, grace: float = 2.0) -> None:
        """After a collective failed: if a rank died (its exit may be reaped a moment after its socket
        closed), end the worker as the watchdog does, before the engine's error reads as a sick engine."""
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not self.stopping:
            self._exit_if_one_died()
            time.sleep(0.05)

    def _exit_if_one_died(self) -> None:
        for rank, p in self.procs.items():
            code = p.poll()
            if code is not None and not self.stopping:
                log.error("tensor-parallel rank %d (pid %d) died with status %s: stopping this worker; the jobs "
                          "it holds go back to the queue", rank, p.pid, code)
                self.kill()
                logging.shutdown()
                os._exit(EXIT_RANK_DIED)

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class DriverModel(nn.Module):
    """Rank 0's model: every call is sent to the other ranks first, then run on rank 0's own shard."""

    def __init__(self, local: nn.Module, ps: ParallelState, procs: RankProcesses, hidden_size: int) -> None:
        super().__init__()
        self.local: Any = local  # a CausalLM (engine/models/base.py)
        self.ps, self.procs, self.hidden_size = ps, procs, hidden_size
        self.closed = False
        self.host_threads = torch.get_num_threads()  # restored at close: the ranks shared the cores

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        with self._collectives():
            self._send(("forward", input_ids.cpu(), positions.cpu(), host_meta(meta)))
            return self.local(input_ids, positions, kv_caches, meta, backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._collectives():
            self._send(("logits", hidden.shape[0]))
            hidden = hidden.contiguous()
            dist.broadcast(hidden, src=0, group=self.ps.group)
            return self.local.compute_logits(hidden)

    @contextlib.contextmanager
    def _collectives(self) -> Iterator[None]:
        """A collective that fails because a rank died ends the worker with EXIT_RANK_DIED, not as a sick
        engine: the watchdog polls and may not have seen the death yet."""
        try:
            yield
        except RuntimeError:
            self.procs.exit_if_a_rank_died()
            raise

    def kv_spec(self) -> list[LayerKVSpec]:
        return self.local.kv_spec()

    def use_fused_kernels(self, kernels: Any) -> None:
        if hasattr(self.local, "use_fused_kernels"):
            self.local.use_fused_kernels(kernels)

    def allocate_kv(self, num_blocks: int) -> None:
        """The other ranks allocate their caches (each for its own KV heads) with the same block count."""
        self._send(("alloc", num_blocks))

    def close(self) -> None:
        """Stop the other ranks and leave the group; the model cannot run afterwards."""
        if self.closed:
            return
        self.procs.stopping = True
        try:
            self._send(("stop",))
        except RuntimeError as e:  # a rank already gone
            log.warning("tensor parallel: stopping the ranks: %s", e)
        self.closed = True
        self.procs.stop()
        state.destroy()
        torch.set_num_threads(self.host_threads)

    def _send(self, msg: tuple[Any, ...]) -> None:
        if self.closed:
            raise RuntimeError("this tensor-parallel engine was closed")
        dist.broadcast_object_list([msg], src=0, group=self.ps.cpu_group)


def host_meta(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata with its tensors on the host and no backend groups (each rank prepares its own)."""
    moved = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
    for name, value in moved.items():
        if isinstance(value, torch.Tensor):
            moved[name] = value.cpu()
    moved["groups"] = None
    return AttentionMetadata(**moved)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_current: DriverModel | None = None


def start(net: nn.Module, shard: Callable[[nn.Module, ParallelState], nn.Module], model_path: str, gguf_file: str | None, config: EngineConfig,
          cpu_linear: str, dtype: torch.dtype, device: torch.device, max_model_len: int) -> DriverModel:
    """Start ranks 1..N-1, join the group as rank 0, keep rank 0's shard of ``net`` (``shard(net, ps)`` returns it);
    returns rank 0's model. One tensor-parallel engine per process: a previous one is closed."""
    global _current
    if _current is not None:
        _current.close()
    world = config.tensor_parallel_size
    threads = rank_threads(device, world)
    spec = RankSpec(model_path, gguf_file, dict(dataclasses.asdict(config), cpu_linear=cpu_linear),
                    str(dtype).removeprefix("torch."), device.type, max_model_len, world,
                    f"tcp://127.0.0.1:{free_port()}", os.getpid(), threads)
    procs = RankProcesses(spec)
    try:
        with procs.watch_joining():
            ps = state.init(0, world, spec.init_method, device)
        net = shard(net, ps)
        procs.wait_ready()
    except BaseException:
        procs.stopping = True
        procs.kill()
        state.destroy()
        raise
    driver = DriverModel(net, ps, procs, cast(Any, net).config.get_text_config().hidden_size)
    if threads:
        torch.set_num_threads(threads)
    procs.watch()
    _current = driver
    return driver


@atexit.register
def _close_current() -> None:
    if _current is not None:
        _current.close()


def rank_threads(device: torch.device, world: int) -> int:
    """CPU ranks share the host's cores: each gets its share (0: leave torch's default)."""
    if device.type != "cpu":
        return 0
    return max(1, (os.cpu_count() or 1) // world)


# ---- ranks 1..N-1 ---------------------------------------------------------------------------------
def rank_main(rank: int, spec: RankSpec) -> None:
    from sluice.engine.kv_quant import cache_dtype
    from sluice.engine.loader import ModelSource
    from sluice.engine.model_runner import allocate_kv_caches, elementwise_kernels, make_backend
    from sluice.engine.parallel.build import build_shard

    _exit_with_parent(spec.parent_pid)
    config = from_json(spec.config)
    device = state.rank_device(torch.device(spec.device), rank)
    dtype = getattr(torch, spec.dtype)
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    ps = state.init(rank, spec.world_size, spec.init_method, device)
    try:
        src = ModelSource(spec.model_path, spec.gguf_file)
        net = build_shard(src, config, dtype, device, spec.max_model_len, ps)
        backend = make_backend(config, device)
        if hasattr(net, "use_fused_kernels"):
            net.use_fused_kernels(elementwise_kernels(backend, device))
    except Exception as e:  # told to rank 0 in one line; it raises it
        _tell_rank0(f"error: {type(e).__name__}: {e}".replace("\n", " "))
        raise
    _tell_rank0("ready")
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
    hidden_size = net.config.get_text_config().hidden_size
    with torch.inference_mode():
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=ps.cpu_group)
            msg = box[0]
            if msg[0] == "forward":
                _, ids, pos, meta = msg
                meta = _to(meta, device)
                if backend.caps.host_prepare:
                    meta.groups = backend.prepare(meta)
                net(ids.to(device), pos.to(device), kv_caches, meta, backend)
            elif msg[0] == "logits":
                hidden = torch.empty(msg[1], hidden_size, dtype=dtype, device=device)
                dist.broadcast(hidden, src=0, group=ps.group)
                net.compute_logits(hidden)
            elif msg[0] == "alloc":
                kv_caches = []
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                kv_dtype = cache_dtype(config.kv_cache_dtype, dtype)  # as rank 0's: int8 where asked
                kv_caches = allocate_kv_caches(net.kv_spec(), msg[1], config.block_size, kv_dtype, device)
                if device.type == "cuda" and backend.caps.reads_unwritten_slots:
                    for k, v in kv_caches:  # rank 0 zeroes blocks as they are first used; here all at once
                        k.zero_()
                        v.zero_()
            elif msg[0] == "stop":
                break
    state.destroy()


_ready_out: Any = None


def _tell_rank0(line: str) -> None:
    out = _ready_out or sys.stdout
    print(line, file=out, flush=True)


def _to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if device.type == "cpu":
        return meta
    moved: dict[str, Any] = {}
    for f in dataclasses.fields(meta):
        value = getattr(meta, f.name)
        moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
    return AttentionMetadata(**moved)


def _exit_with_parent(parent_pid: int, interval: float = 0.5) -> None:
    """Exit when rank 0's process is gone (its socket errors may not reach a rank that waits idle)."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(0)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def main(argv: list[str]) -> None:
    rank, spec = int(argv[0]), RankSpec(**json.loads(argv[1]))
    # stdout is rank 0's pipe for the one "ready" line; anything else printed goes to stderr.
    global _ready_out
    _ready_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    logging.basicConfig(level=logging.WARNING, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    faulthandler.register(signal.SIGUSR1)  # kill -USR1 <pid>: every thread's stack on stderr (a hung rank)
    try:
        rank_main(rank, spec)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        logging.shutdown()
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
