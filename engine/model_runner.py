"""One step on the device: pack the scheduled tokens into tensors, run the model, sample."""

from __future__ import annotations

import itertools
import logging
from types import ModuleType
from typing import Any, cast

import numpy as np
import torch
from sluice.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVSpec,
    TorchAttention,
    allocate_kv,
)
from sluice.engine.block_table import BlockTableRows
from sluice.engine.config import EngineConfig
from sluice.engine.cpu_attention import CpuPagedAttention
from sluice.engine.cpu_attention import describe as describe_cpu_attention
from sluice.engine.graph_runner import DecodeGraphRunner
from sluice.engine.guided import apply_guided_masks
from sluice.engine.kv_quant import cache_dtype, row_width
from sluice.engine.lora.batch import adapter_order
from sluice.engine.lora.manager import LoraManager
from sluice.engine.models.base import CausalLM
from sluice.engine.mrope import in_prompt, step_positions
from sluice.engine.outputs import TokenLogprob
from sluice.engine.prompt_logprobs import record_prompt_logprobs, wants_prompt_logprobs
from sluice.engine.quant.weight_bytes import weight_bytes
from sluice.engine.sampler import sample
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.scheduler import ScheduledBatch
from sluice.engine.sequence import Sequence
from sluice.engine.triton_attention import TritonAttention
from sluice.engine.vision import VisionEncoder, needs_images, step_images

log = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 4 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, device: torch.device, dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.kv_dtype = cache_dtype(config.kv_cache_dtype, dtype)  # what the cache holds: dtype, or int8
        if config.kv_cache_dtype == "fp8":
            log.info("--kv-cache-dtype fp8: the KV cache holds int8 with a scale per token and KV head (e4m3 storage "
                     "is not built; int8's steps are finer for the same bytes)")
        self.block_size = config.block_size
        # The engine's own length limit (the model's, or max_model_len where smaller): positions run
        # 0..max_model_len-1, whichever path implements the model; the native rotary tables end there too.
        self.max_model_len = max_model_len
        self.backend = make_backend(config, device)
        if isinstance(self.backend, CpuPagedAttention):
            log.info("attention: C++ op, %s", describe_cpu_attention(dtype, {x.head_dim for x in model.kv_spec()}))
        self.kernels = elementwise_kernels(self.backend, device)
        if hasattr(model, "use_fused_kernels"):  # the native path; the transformers path runs its own layers
            model.use_fused_kernels(self.kernels)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_tables = BlockTableRows(config.max_num_seqs)
        self.decode_runner: DecodeGraphRunner | None = None
        self.graph_reserve_bytes = 0  # what KV sizing left for the decode graphs (CUDA)
        self.lora: LoraManager | None = None  # LoRA adapters: each step tells it which rows take which
        self.vision: VisionEncoder | None = None  # a vision-language model's images (engine/vision.py)

    # ---- KV cache -------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model.kv_spec(), self.block_size, self.kv_dtype)

    def kv_budget_bytes(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.config.memory_budget is not None:  # what the weights' real bytes leave (int8: more)
            left = self.config.memory_budget - weight_bytes(cast(torch.nn.Module, self.model))
            return left if self.device.type != "cuda" else min(left, self._cuda_free_after_warmup())
        if self.device.type != "cuda":
            return _DEFAULT_CPU_KV_BYTES
        return self._cuda_free_after_warmup()  # measured after loading: counts the weights' real bytes

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """The engine's KV cache; decode graphs capture its addresses, so they are captured here."""
        self._allocate(num_blocks)
        if self._pad_decode() and self.lora is None:  # a graph would freeze one step's adapter rows
            self.decode_runner = self._decode_runner(num_blocks)
            if self._capture_graphs():
                self.decode_runner.capture()  # a failed capture is logged and leaves the steps eager

    def _allocate(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.model.kv_spec(), num_blocks, self.block_size, self.kv_dtype,
                                            self.device)
        if hasattr(self.model, "allocate_kv"):  # tensor parallel: the other ranks allocate theirs (engine/parallel/)
            self.model.allocate_kv(num_blocks)
        self.num_zeroed_blocks = num_blocks if self.device.type == "cpu" else 0  # allocate_kv zeroes CPU caches

    def _capture_graphs(self) -> bool:
        # Not under tensor parallelism: each step's metadata is sent to the other ranks from the host.
        return (self.device.type == "cuda" and not self.config.enforce_eager and self.backend.caps.cuda_graphs
                and self.config.tensor_parallel_size == 1)

    def _pad_decode(self) -> bool:
        return self.config.pad_decode if self.config.pad_decode is not None else self._capture_graphs()

    def _decode_runner(self, num_blocks: int) -> DecodeGraphRunner:
        max_blocks = min(-(-self.max_model_len // self.block_size), num_blocks)
        return DecodeGraphRunner(self.model, self.backend, self.kv_caches, self.config.max_num_seqs,
                                 self.block_size, max_blocks, self.device)

    def zero_fresh_blocks(self, num_touched: int) -> None:
        """Zero blocks on first use rather than all at start-up (touching gigabytes takes seconds):
        masked key slots are still multiplied by a zero probability, and 0 * NaN is NaN. A backend
        that never loads a slot before it is written (Triton's masked loads) skips this; a CPU cache
        starts zeroed (engine/huge_pages.py), so all its blocks count as zeroed from the start."""
        if not self.backend.caps.reads_unwritten_slots:
            return
        if num_touched > self.num_zeroed_blocks:
            for k, v in self.kv_caches:
                k[self.num_zeroed_blocks : num_touched] = 0
                v[self.num_zeroed_blocks : num_touched] = 0
            self.num_zeroed_blocks = num_touched

    def _cuda_free_after_warmup(self) -> int:
        """The KV budget from what the device has free once the weights are loaded and a forward pass
        at the largest step has run (``cuda_kv_budget``): other processes' memory counts as taken."""
        torch.cuda.reset_peak_memory_stats(self.device)
        blocks = self.warmup_step()
        peak = torch.cuda.max_memory_allocated(self.device)
        self.graph_reserve_bytes = self._graph_reserve(blocks) if self._capture_graphs() else 0
        self.kv_caches = []
        torch.cuda.empty_cache()
        activations = max(peak - torch.cuda.memory_allocated(self.device), 0)
        free, total = torch.cuda.mem_get_info(self.device)
        return cuda_kv_budget(free, total, self.config.gpu_memory_utilization, activations, self.graph_reserve_bytes)

    @torch.inference_mode()
    def warmup_step(self) -> int:
        """Run the largest step the scheduler can make (``max_num_batched_tokens`` prompt tokens) into a
        cache just big enough for it; returns that cache's block count. The tokens are cut into
        sequences no longer than the rotary tables, which end at the model's length limit."""
        bs = self.block_size
        q_lens = warmup_query_lens(self.config.max_num_batched_tokens, self.max_model_len)
        batch, blocks = ScheduledBatch(), 0
        for i, n in enumerate(q_lens):
            seq = Sequence(-1 - i, "warmup", 0, [0] * n, n, SamplingParams())
            seq.block_table = list(range(blocks, blocks + -(-n // bs)))
            blocks += len(seq.block_table)
            batch.add(seq, n)
        self._allocate(blocks)
        self.zero_fresh_blocks(blocks)
        input_ids, positions, meta, _, _ = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        self.model.compute_logits(hidden[-self.config.max_num_seqs :])
        return blocks

    def _graph_reserve(self, num_blocks: int) -> int:
        """Bytes to leave for the decode graphs' private memory pool: twice the peak of an eager decode
        step at the largest bucket (the buckets share one pool; twice, for its fragmentation)."""
        runner = self._decode_runner(num_blocks)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            runner.run_padding(runner.buckets[-1])
        return 2 * (torch.cuda.max_memory_allocated() - base) + (16 << 20)

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, stop_ids: dict[int, set[int]],
            num_touched_blocks: int) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Compute the batch's new tokens; return (sequence, sampled token, logprob) for each sequence
        whose prompt is now wholly computed, i.e. that produces a token this step."""
        self.zero_fresh_blocks(num_touched_blocks)
        order = adapter_order([s.lora for s in batch.seqs]) if self.lora is not None else None
        if order is not None:  # each adapter's rows one run: its LoRA GEMMs on contiguous slices
            scheduled, batch = batch.seqs, ScheduledBatch([batch.seqs[i] for i in order],
                                                          [batch.num_new_tokens[i] for i in order])
        scoring = wants_prompt_logprobs(batch.seqs)  # prompt logprobs need every computed row's hidden state
        images = self.vision is not None and needs_images(batch.seqs, batch.num_new_tokens)
        graph = self.decode_runner is not None and not scoring and not images and not in_prompt(batch.seqs)
        decoded = self.decode_runner.run(batch) if graph and self.decode_runner is not None else None
        if decoded is not None:  # a decode-only step, padded to its bucket (a graph replay on CUDA)
            hidden, samplers = decoded
        else:
            input_ids, positions, meta, last_rows, samplers = self.prepare(batch)
            if images and self.vision is not None:  # image rows replace those tokens' embeddings
                step = step_images(self.vision, batch.seqs, batch.num_new_tokens)
                hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend, images=step)  # type: ignore[call-arg]
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            if scoring:
                record_prompt_logprobs(self.model, hidden, batch.seqs, batch.num_new_tokens)
            hidden = hidden[last_rows]
        if not samplers:
            return []
        logits = self.model.compute_logits(hidden)  # sampled where it lies: only token ids come back
        apply_guided_masks(logits, samplers)  # structured output: masks the constrained rows in place
        with torch.profiler.record_function("sluice::sample"):  # one row in bench/profile_step.py's table
            out = sample(logits, samplers, [stop_ids.get(s.seq_id, set()) for s in samplers], self.kernels)
        sampled = list(zip(samplers, out.token_ids, out.logprobs, strict=True))
        if order is not None:  # back in the scheduler's order: finished requests come back in it
            position = {id(s): i for i, s in enumerate(scheduled)}
            sampled.sort(key=lambda r: position[id(r[0])])
        return sampled

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        """Pack the step: every array is computed by numpy over the whole batch; per sequence, Python
        only reads its counters and new token ids."""
        bs, seqs = self.block_size, batch.seqs
        starts = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        q_lens = np.asarray(batch.num_new_tokens, dtype=np.int64)
        ends = starts + q_lens
        cu = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        new_tokens = (s.token_ids[a:b] for s, a, b in zip(seqs, starts.tolist(), ends.tolist(), strict=True))
        ids = np.fromiter(itertools.chain.from_iterable(new_tokens), dtype=np.int64, count=int(cu[-1]))
        rows = self.block_tables.rows_for(seqs)
        token_seq = np.repeat(np.arange(len(seqs)), q_lens)
        positions = np.arange(cu[-1]) - cu[token_seq] + starts[token_seq]
        rope = step_positions(seqs, starts, ends, positions)  # [3, T] when a sequence has M-RoPE positions
        slots = self.block_tables.table[rows[token_seq], positions // bs].astype(np.int64) * bs + positions % bs
        # A sequence whose last known token is computed this step samples its next one from that row.
        num_tokens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        sampling = np.flatnonzero(ends == num_tokens)
        width = -(-int(ends.max()) // bs)
        q_lens_t = torch.from_numpy(q_lens)
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(cu.astype(np.int32)),
            seq_lens=torch.from_numpy(ends.astype(np.int32)),
            slot_mapping=torch.from_numpy(slots),
            block_tables=torch.from_numpy(self.block_tables.table[rows, :width]),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(ends.max()),
            decode_idx=torch.nonzero(q_lens_t == 1).flatten(),
            prefill_idx=torch.nonzero(q_lens_t > 1).flatten(),
        )
        meta = _to_device(meta, self.device)
        if self.backend.caps.host_prepare:
            meta.groups = self.backend.prepare(meta)
        if self.lora is not None:
            self.lora.begin_step([s.lora for s in seqs], batch.num_new_tokens)
        input_ids = _h2d(torch.from_numpy(ids), self.device)
        pos_t = _h2d(torch.from_numpy(positions if rope is None else rope), self.device)
        last_rows = _h2d(torch.from_numpy(cu[1:][sampling] - 1), self.device)
        return input_ids, pos_t, meta, last_rows, [seqs[i] for i in sampling.tolist()]


def cuda_kv_budget(free: int, total: int, utilization: float, activations: int, graph_reserve: int) -> int:
    """Bytes for the KV cache: of ``utilization`` x ``total``, take away what anyone holds now (``total -
    free``: this process's weights and CUDA context, and other processes' memory), the step's activation
    peak above what stays allocated, and the reserve left for the decode graphs' pool."""
    in_use = total - free
    return max(int(total * utilization) - in_use - activations - graph_reserve, 0)


def warmup_query_lens(num_tokens: int, max_positions: int) -> list[int]:
    """``num_tokens`` prompt tokens as chunks of at most ``max_positions`` (the rotary tables' rows)."""
    full, rest = divmod(num_tokens, max_positions)
    return [max_positions] * full + ([rest] if rest else [])


def kv_bytes_per_block(spec: list[LayerKVSpec], block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in every layer, each layer with its own head count and size; ``dtype`` is the
    cache's (int8: each row's scale counts too)."""
    elem = dtype.itemsize
    return sum(2 * block_size * layer.num_kv_heads * row_width(layer.head_dim, dtype) * elem for layer in spec)


def allocate_kv_caches(spec: list[LayerKVSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, all with the same blocks, so one block table serves every layer."""
    caches = []
    for layer in spec:
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        caches.append((allocate_kv(*shape, dtype, device), allocate_kv(*shape, dtype, device)))
    return caches


def make_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    """auto: the Triton kernels on CUDA; on CPU the C++ op, or PyTorch where it cannot be built. A backend
    that runs on one device type only is refused elsewhere, in one line."""
    name = config.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
        if name == "cpu":
            from sluice.kernels.cpu_ops import available

            ok, why = available()
            if not ok:
                log.warning("C++ CPU attention unavailable (%s); using the PyTorch fallback", why)
                name = "torch"
    backend: AttentionBackend
    if name == "triton":
        backend = TritonAttention()
    elif name == "cpu":
        backend = CpuPagedAttention()
    else:
        backend = TorchAttention(config.block_size)
    if backend.caps.device_type not in (None, device.type):
        raise ValueError(f"attention_backend {name!r} runs on {backend.caps.device_type} only, not {device.type}")
    return backend


def elementwise_kernels(backend: AttentionBackend, device: torch.device) -> ModuleType | None:
    """The fused RMSNorm (+ residual), rotary and SiLU * up kernels that go with the attention backend, so a
    layer's small ops are one launch or dispatch each: Triton's beside Triton attention on CUDA, the C++ ops
    (and their argmax) beside the C++ attention op, built with it; None (eager PyTorch) beside the fallback."""
    kind = backend.caps.fused_kernels
    if kind == "triton" and device.type == "cuda":  # not under the interpreter: eager ops are the reference there
        from sluice.kernels import fused

        return fused
    if kind == "cpu":
        from sluice.kernels import cpu_fused

        return cpu_fused
    return None


def _h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: on CUDA through pinned memory, so the copy is queued without waiting
    (from pageable memory it would block the host until the stream reaches it)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if device.type == "cpu":
        return meta
    moved: dict[str, Any] = {}
    for name, value in vars(meta).items():
        moved[name] = _h2d(value, device) if isinstance(value, torch.Tensor) else value
    return AttentionMetadata(**moved)
