"""One step on the device: pack the scheduled tokens into tensors, run the model, sample."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata, TorchAttention, allocate_kv
from engine.config import EngineConfig
from engine.models.llama import LlamaForCausalLM
from engine.outputs import TokenLogprob
from engine.sampler import sample
from engine.scheduler import ScheduledBatch
from engine.sequence import Sequence

log = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 4 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = config.block_size
        self.backend = make_backend(config, device)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    # ---- KV cache -------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        m = self.model
        elem = torch.finfo(self.dtype).bits // 8
        return 2 * len(m.layers) * self.block_size * m.config.num_key_value_heads * m.head_dim * elem

    def kv_budget_bytes(self) -> int:
        if self.config.kv_cache_memory is not None:
            return self.config.kv_cache_memory
        if self.device.type != "cuda":
            return _DEFAULT_CPU_KV_BYTES
        return self._cuda_free_after_warmup()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        m = self.model
        shape = (num_blocks, self.block_size, m.config.num_key_value_heads, m.head_dim)
        self.kv_caches = [(allocate_kv(*shape, self.dtype, self.device), allocate_kv(*shape, self.dtype, self.device))
                          for _ in m.layers]
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
        bs = self.block_size
        ids: list[int] = []
        positions, slots = [], []
        seq_lens, q_lens, samplers, last_rows = [], [], [], []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            pos = np.arange(start, end)
            positions.append(pos)
            slots.append(np.asarray(seq.block_table)[pos // bs] * bs + pos % bs)
            q_lens.append(n)
            seq_lens.append(end)
            if end == seq.num_tokens:  # the last known token is computed: its logits give the next one
                samplers.append(seq)
                last_rows.append(len(ids) - 1)
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = np.zeros((len(batch), max_blocks), dtype=np.int32)
        for i, seq in enumerate(batch.seqs):
            tables[i, : len(seq.block_table)] = seq.block_table
        q_lens_t = torch.tensor(q_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=torch.nn.functional.pad(q_lens_t.cumsum(0, dtype=torch.int32), (1, 0)),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            slot_mapping=torch.from_numpy(np.concatenate(slots)).long(),
            block_tables=torch.from_numpy(tables),
            max_query_len=max(q_lens),
            max_seq_len=max(seq_lens),
            decode_idx=torch.nonzero(q_lens_t == 1).flatten(),
            prefill_idx=torch.nonzero(q_lens_t > 1).flatten(),
        )
        meta = _to_device(meta, self.device)
        prepare = getattr(self.backend, "prepare", None)
        if prepare is not None:
            meta.groups = prepare(meta)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.from_numpy(np.concatenate(positions)).to(self.device)
        return input_ids, pos_t, meta, torch.tensor(last_rows, dtype=torch.long, device=self.device), samplers


def make_backend(config: EngineConfig, device: torch.device) -> AttentionBackend:
    name = config.attention_backend
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from engine.triton_attention import TritonAttention

        return TritonAttention()
    return TorchAttention(config.block_size)


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    if device.type == "cpu":
        return meta
    moved: dict[str, Any] = {}
    for name, value in vars(meta).items():
        moved[name] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
    return AttentionMetadata(**moved)
