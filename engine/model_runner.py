"""One step on the device: pack the scheduled tokens into tensors, run the model, sample."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata, LayerKVSpec, TorchAttention, allocate_kv
from engine.block_table import BlockTableRows
from engine.config import EngineConfig
from engine.models.base import CausalLM
from engine.outputs import TokenLogprob
from engine.sampler import sample
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

log = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 4 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.backend = make_backend(config, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_tables = BlockTableRows(config.max_num_seqs)

    # ---- KV cache -------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model.kv_spec(), self.block_size, self.dtype)

    def kv_budget_bytes(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type != "cuda":
            return _DEFAULT_CPU_KV_BYTES
        return self._cuda_free_after_warmup()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.model.kv_spec(), num_blocks, self.block_size, self.dtype, self.device)
        self.num_zeroed_blocks = 0

    def zero_fresh_blocks(self, num_touched: int) -> None:
        """Zero blocks on first use rather than all at start-up (touching gigabytes takes seconds):
        masked key slots are still multiplied by a zero probability, and 0 * NaN is NaN."""
        if num_touched > self.num_zeroed_blocks:
            for k, v in self.kv_caches:
                k[self.num_zeroed_blocks : num_touched] = 0
                v[self.num_zeroed_blocks : num_touched] = 0
            self.num_zeroed_blocks = num_touched

    def _cuda_free_after_warmup(self) -> int:
        """What is left of ``gpu_memory_utilization`` after a forward pass at the largest step."""
        n = self.config.max_num_batched_tokens
        blocks = -(-n // self.block_size)
        self.allocate_kv_cache(blocks)
        self.zero_fresh_blocks(blocks)
        torch.cuda.reset_peak_memory_stats()
        seq_lens = torch.tensor([n], dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=seq_lens.to(self.device),
            slot_mapping=torch.arange(n, dtype=torch.long, device=self.device),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=self.device)[None],
            max_query_len=n,
            max_seq_len=n,
        )
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            hidden = self.model(ids, torch.arange(n, device=self.device), self.kv_caches, meta, self.backend)
            self.model.compute_logits(hidden[-self.config.max_num_seqs :])
        peak = torch.cuda.max_memory_allocated()
        self.kv_caches = []
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        return max(int(total * self.config.gpu_memory_utilization) - peak, 0)

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, stop_ids: dict[int, set[int]],
            num_touched_blocks: int) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Compute the batch's new tokens; return (sequence, sampled token, logprob) for each sequence
        whose prompt is now wholly computed, i.e. that produces a token this step."""
        self.zero_fresh_blocks(num_touched_blocks)
        input_ids, positions, meta, last_rows, samplers = self.prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        if not samplers:
            return []
        logits = self.model.compute_logits(hidden[last_rows]).cpu()
        out = sample(logits, samplers, [stop_ids.get(s.seq_id, set()) for s in samplers])
        return list(zip(samplers, out.token_ids, out.logprobs, strict=True))

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
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None:
            meta.groups = prepare(meta)
        input_ids = torch.from_numpy(ids).to(self.device)
        pos_t = torch.from_numpy(positions).to(self.device)
        last_rows = torch.from_numpy(cu[1:][sampling] - 1).to(self.device)
        return input_ids, pos_t, meta, last_rows, [seqs[i] for i in sampling.tolist()]


def kv_bytes_per_block(spec: list[LayerKVSpec], block_size: int, dtype: torch.dtype) -> int:
    """K and V of one block in every layer, each layer with its own head count and size."""
    elem = torch.finfo(dtype).bits // 8
    return sum(2 * block_size * layer.num_kv_heads * layer.head_dim * elem for layer in spec)


def allocate_kv_caches(spec: list[LayerKVSpec], num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, all with the same blocks, so one block table serves every layer."""
    caches = []
    for layer in spec:
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        caches.append((allocate_kv(*shape, dtype, device), allocate_kv(*shape, dtype, device)))
    return caches


def make_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    """auto: the Triton kernels on CUDA; on CPU the C++ op, or PyTorch where it cannot be built."""
    name = config.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
        if name == "cpu":
            from kernels.cpu_attention import available

            ok, why = available()
            if not ok:
                log.warning("C++ CPU attention unavailable (%s); using the PyTorch fallback", why)
                name = "torch"
    if name == "triton":
        from engine.triton_attention import TritonAttention

        return TritonAttention()
    if name == "cpu":
        from engine.cpu_attention import CpuPagedAttention

        return CpuPagedAttention()
    return TorchAttention(config.block_size)


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if device.type == "cpu":
        return meta
    moved: dict[str, Any] = {}
    for name, value in vars(meta).items():
        moved[name] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
    return AttentionMetadata(**moved)
