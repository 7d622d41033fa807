"""Decode steps at a few fixed batch sizes, so that each size can be captured once as a CUDA graph.

A step whose every sequence adds one token is padded to the next bucket (1, 2, 4, 8, 16, then
multiples of 16 up to ``max_num_seqs``). Its inputs live in static buffers sized for the largest
bucket, and the metadata of bucket ``b`` views their first ``b`` rows, so every shape the model sees
depends on the bucket alone. A padded row writes its K/V to slot -1 (skipped) and has context length
0, so it attends to nothing and nothing reads it.

On CUDA with the Triton backend each bucket is captured at start-up and replayed; elsewhere (CPU,
``enforce_eager``) the padded step runs eagerly, which is how the padding is tested on CPU. A capture
that fails (a host sync inside a model's own modules: transformers' dynamic RoPE checks, MoE routing's
``.nonzero()``) is logged and the padded steps run eagerly instead. Prompt chunks run eagerly through
``ModelRunner.prepare`` as before.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import numpy as np
import torch
from sluice.engine.attention import AttentionBackend, AttentionMetadata
from sluice.engine.models.base import CausalLM
from sluice.engine.mrope import decode_deltas
from sluice.engine.scheduler import ScheduledBatch
from sluice.engine.sequence import Sequence

log = logging.getLogger(__name__)

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then every multiple of 16 below ``max_num_seqs``, then ``max_num_seqs`` itself."""
    small = [b for b in (1, 2, 4, 8, 16) if b < max_num_seqs]
    return small + list(range(32, max_num_seqs, 16)) + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= n)


def is_decode_only(batch: ScheduledBatch) -> bool:
    return len(batch) > 0 and all(n == 1 for n in batch.num_new_tokens)


class _StaticInputs:
    """The step's inputs for the largest bucket. On CUDA they are filled in pinned host memory and
    copied over in one non-blocking copy each; on CPU the host side is the device side. Of the block
    table only the columns this step's longest sequence uses travel (the kernels read no further), packed
    into a contiguous staging row and spread into the table on the device."""

    def __init__(self, max_bs: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"

        def pair(*shape: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            host = torch.zeros(*shape, dtype=dtype, pin_memory=pin)
            return host, (host.to(device) if pin else host)

        self.ids_h, self.ids = pair(max_bs, dtype=torch.long)
        self.pos_h, self.pos = pair(max_bs, dtype=torch.long)
        self.slots_h, self.slots = pair(max_bs, dtype=torch.long)
        self.lens_h, self.lens = pair(max_bs, dtype=torch.int32)
        self.tables = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.stage_h: torch.Tensor | None
        self.stage: torch.Tensor | None
        self.stage_h, self.stage = pair(max_bs * max_blocks, dtype=torch.int32) if pin else (None, None)
        self.qsl = torch.arange(max_bs + 1, dtype=torch.int32, device=device)  # one query each, forever
        self.rows = torch.arange(max_bs, device=device)
        self.copies = [(self.ids_h, self.ids), (self.pos_h, self.pos), (self.slots_h, self.slots),
                       (self.lens_h, self.lens)]
        self.table_copy_elems = 0  # block-table entries sent by the last fill (for tests)
        # Host rows are rewritten next step only once the last copy out of them has finished.
        self.sent = torch.cuda.Event() if pin else None

    def fill(self, seqs: list[Sequence], bucket: int, block_size: int) -> None:
        """Write the sequences' rows, pad the rest of the bucket, and send the bucket's rows over."""
        if self.sent is not None:
            self.sent.synchronize()
        n = len(seqs)
        pos = np.fromiter((s.num_computed_tokens for s in seqs), dtype=np.int64, count=n)
        ids, slots = self.ids_h.numpy(), self.slots_h.numpy()
        ids[:n] = [s.token_ids[s.num_computed_tokens] for s in seqs]
        self.pos_h.numpy()[:n] = pos + decode_deltas(seqs)  # M-RoPE: a decode token's position is index + delta
        self.lens_h.numpy()[:n] = pos + 1
        width = max(len(s.block_table) for s in seqs)
        tables = self._table_rows(bucket, width)
        tables[n:] = 0
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        slots[:n] = tables[np.arange(n), pos // block_size].astype(np.int64) * block_size + pos % block_size
        self.pad(n, bucket)
        for host, dev in self.copies:
            if dev is not host:
                dev[:bucket].copy_(host[:bucket], non_blocking=True)
        if self.stage is not None and self.stage_h is not None:
            used = bucket * width
            self.stage[:used].copy_(self.stage_h[:used], non_blocking=True)
            self.tables[:bucket, :width].copy_(self.stage[:used].view(bucket, width))
        self.table_copy_elems = bucket * width
        if self.sent is not None:
            self.sent.record()

    def _table_rows(self, bucket: int, width: int) -> np.ndarray:
        """Where this step's ``[bucket, width]`` block-table rows are written on the host."""
        if self.stage_h is not None:
            return self.stage_h[: bucket * width].view(bucket, width).numpy()
        return self.tables[:bucket, :width].numpy()

    def pad(self, start: int, stop: int) -> None:
        """Rows ``start:stop`` are padding: token 0 at position 0, no slot, no context."""
        for t in (self.ids_h, self.pos_h, self.lens_h):
            t[start:stop] = 0
        self.slots_h[start:stop] = -1  # their table rows are never read: context 0


class DecodeGraphRunner:
    """Runs decode-only steps padded to a bucket; replays a captured CUDA graph for it where there is one."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, kv_caches: KVCaches, max_num_seqs: int,
                 block_size: int, max_blocks: int, device: torch.device) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.buckets = decode_buckets(max_num_seqs)
        self.inputs = _StaticInputs(self.buckets[-1], max_blocks, device)
        # The table's whole width bounds the context: the decode kernel picks its split count from it, and
        # each sequence cuts its own context into that many ranges (kernels/paged_attention.py).
        self.metas = {b: self._meta(b, max_blocks * block_size) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.steps = dict.fromkeys(self.buckets, 0)  # decode steps run per bucket (for bench/ and tests)
        self.capture_s = 0.0
        self.pool_bytes = 0  # what capture added to the allocator's reserved memory
        self.capture_error: str | None = None  # why capture failed, where it did (the steps then run eagerly)

    def _meta(self, b: int, max_seq_len: int) -> AttentionMetadata:
        x = self.inputs
        return AttentionMetadata(query_start_loc=x.qsl[: b + 1], seq_lens=x.lens[:b], slot_mapping=x.slots[:b],
                                 block_tables=x.tables[:b], max_query_len=1, max_seq_len=max_seq_len,
                                 decode_idx=x.rows[:b], prefill_idx=x.rows[:0])

    def _forward(self, b: int) -> torch.Tensor:
        meta = self.metas[b]
        if self.backend.caps.host_prepare:  # host-side grouping (PyTorch backend): per step, never captured
            meta = replace(meta, groups=self.backend.prepare(meta))
        return self.model(self.inputs.ids[:b], self.inputs.pos[:b], self.kv_caches, meta, self.backend)

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]] | None:
        """The hidden states of the sequences that sample this step, and those sequences; None when the
        step is not decode-only (or is larger than the largest bucket) and must run eagerly."""
        if not is_decode_only(batch) or len(batch) > self.buckets[-1]:
            return None
        b = bucket_for(len(batch), self.buckets)
        self.steps[b] += 1
        self.inputs.fill(batch.seqs, b, self.block_size)
        graph = self.graphs.get(b)
        if graph is not None:
            graph.replay()
            hidden = self.outputs[b]
        else:
            hidden = self._forward(b)
        # A one-token step is a decode or a prompt's last token, except a one-token chunk mid-prompt.
        rows = [i for i, s in enumerate(batch.seqs) if s.num_computed_tokens + 1 == s.num_tokens]
        if len(rows) == len(batch):
            return hidden[: len(batch)], batch.seqs
        return hidden[torch.tensor(rows, device=hidden.device)], [batch.seqs[i] for i in rows]

    def run_padding(self, b: int) -> torch.Tensor:
        """An eager step of bucket ``b`` that is all padding: it reads and writes no cache slot."""
        self.inputs.pad(0, b)
        for host, dev in self.inputs.copies:
            if dev is not host:
                dev[:b].copy_(host[:b])
        return self._forward(b)

    def capture(self) -> bool:
        """Capture every bucket; False where capture failed, which is logged, and the graphs are dropped
        so that every decode step runs eagerly (still padded) rather than the engine failing to start."""
        try:
            self._capture_all()
        except Exception as e:  # noqa: BLE001 - any failure inside the model's modules during capture
            self.graphs.clear()
            self.outputs.clear()
            self.capture_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("CUDA graph capture failed (%s); decode steps run eagerly", self.capture_error)
            return False
        return True

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every bucket, largest first so that the smaller ones reuse its memory pool."""
        # torch.cuda.graph empties the allocator's cache on entry: measure the pool from an empty cache
        # at both ends, or what the cache held before would be counted off it.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        t0, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        pool = None
        for b in reversed(self.buckets):
            self.run_padding(b)  # compiles the kernels for this shape outside the capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self.capture_s = time.perf_counter() - t0
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved
        log.info("captured decode CUDA graphs for batch sizes %s in %.1fs (%d MiB)", self.buckets, self.capture_s,
                 self.pool_bytes >> 20)
