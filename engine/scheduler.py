"""Iteration-level FCFS scheduling with chunked prefill and preemption by recomputation.

Each step spends a token budget: running sequences first (a decode costs one token, an unfinished
prompt a chunk of it), then waiting sequences in arrival order while blocks, ``max_num_seqs`` and the
budget allow. When a running sequence needs a block and none is free, the newest running sequence
gives its blocks back and waits again at the head of the queue.

After the step, ``postprocess`` appends each sampled token and finishes the sequences that hit a stop
(``check_stop``: EOS or a stop token, a stop string, the length limits, a complete structured output).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from sluice.engine.block_manager import BlockManager
from sluice.engine.config import EngineConfig
from sluice.engine.guided import advance_guide
from sluice.engine.sequence import Sequence, SequenceStatus

# A first-in-line sequence whose LoRA adapter waits for a slot lets sequences behind it that need no new slot
# (their adapter runs already, or the base) go first, at most this many times in a row; each admission looks
# at most this far down the queue.
LORA_BYPASS_LIMIT = 64
LORA_LOOKAHEAD = 256


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_ids: set[int] | None = None,
                 max_model_len: int | None = None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.eos_ids = eos_ids or set()
        self.max_model_len = max_model_len or sys.maxsize
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stop_ids: dict[int, set[int]] = {}  # per sequence: ids that min_tokens holds back (the sampler's)
        self.num_preemptions = 0
        self.lora_bypasses = 0  # admissions past the first in line, blocked on its adapter's slot

    def add(self, seq: Sequence) -> None:
        p = seq.params
        if p.min_tokens:
            self.stop_ids[seq.seq_id] = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
        self._wait(seq)

    def _wait(self, seq: Sequence, first: bool = False) -> None:
        """Into the waiting queue, which is kept in priority order: after the sequences of its priority
        and higher (``first``: ahead of its own priority, as a preempted sequence goes back)."""
        if not self.waiting or (self.waiting[-1].priority >= seq.priority and not first):
            self.waiting.append(seq)  # the common case: one priority
            return
        i = 0
        while i < len(self.waiting) and (self.waiting[i].priority > seq.priority or
                                         (self.waiting[i].priority == seq.priority and not first)):
            i += 1
        self.waiting.insert(i, seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        self._make_room_for_priority()
        preempted = self._schedule_running(batch, budget)
        budget -= sum(batch.num_new_tokens)
        if not preempted and self._may_admit():
            self._schedule_waiting(batch, budget)
        return batch

    def postprocess(self, sampled: list[tuple[Sequence, int, Any]], now: float) -> None:
        """Append each sequence's sampled token (and logprob); finish those that hit a stop."""
        for seq, token, logprob in sampled:
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq.logprobs is not None:
                seq.logprobs.append(logprob)
            reason = self.check_stop(seq, token)
            if reason is not None:
                self.finish(seq, reason)

    def check_stop(self, seq: Sequence, token: int) -> str | None:
        """Why ``seq`` stops after ``token`` ("stop" | "length"), or None."""
        p = seq.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.detok is not None and seq.detok.stop and seq.detok.update(seq.token_ids):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return advance_guide(seq, token)  # "stop" once a structured output is complete

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take ``seq`` out of the batch and free its blocks now, so a waiting one can start next step."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.time()
        self.stop_ids.pop(seq.seq_id, None)
        if seq.detok is not None:
            seq.detok.finish(seq.token_ids)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> bool:
        """Schedule running sequences oldest first; returns whether anything was preempted."""
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # Only sequences not yet scheduled this step are preempted: those after ``i``, or ``seq`` itself.
            while not self.block_manager.allocate_slots(seq, num_new):
                preempted = True
                if self._preempt(self.running.pop()) is seq:
                    break
            else:
                if num_new:
                    batch.add(seq, num_new)
                    budget -= num_new
                i += 1
        return preempted

    def _may_admit(self) -> bool:
        # The static baseline admits a cohort only once the previous cohort has wholly finished;
        # a cohort still catching up on its prompts may keep filling.
        if self.config.policy == "static":
            return all(s.num_output_tokens == 0 for s in self.running)
        return True

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            i = self._next_to_admit()
            if i is None:
                break  # max_loras adapters are running: the first in line waits for one of them to finish
            seq = self.waiting[i]
            hits = bm.match_prefix(seq)
            num_new = min(seq.num_tokens - len(hits) * bm.block_size, budget)
            if not bm.can_admit(seq, hits, num_new):
                break
            bm.admit(seq, hits)
            bm.allocate_slots(seq, num_new)
            del self.waiting[i]
            if i:
                self.lora_bypasses += 1
            if seq.admitted_time is None:
                seq.admitted_time = time.time()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new

    def _next_to_admit(self) -> int | None:
        """The waiting sequence to admit next: the first, unless its adapter waits for a free slot; then the
        first of its priority whose adapter is running already (or the base), which costs no slot, while the
        first in line has been passed fewer than LORA_BYPASS_LIMIT times (so the running adapters drain and
        it gets its slot); None: nothing may go."""
        head = self.waiting[0]
        if self._lora_fits(head.lora):
            self.lora_bypasses = 0
            return 0
        if self.lora_bypasses >= LORA_BYPASS_LIMIT:
            return None
        for i in range(1, min(len(self.waiting), LORA_LOOKAHEAD)):
            seq = self.waiting[i]
            if seq.priority != head.priority:
                return None
            if seq.lora is None or seq.lora in self.lora_in_use():
                return i
        return None

    def lora_in_use(self) -> set[str]:
        """The adapters of the running sequences."""
        return {s.lora for s in self.running if s.lora is not None}

    def _lora_fits(self, name: str | None) -> bool:
        if name is None:
            return True
        running = self.lora_in_use()
        return name in running or len(running) < self.config.max_loras

    def _preempt(self, seq: Sequence) -> Sequence:
        self.block_manager.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        self._wait(seq, first=True)
        self.num_preemptions += 1
        return seq

    def _make_room_for_priority(self) -> None:
        """The first waiting sequence outranks running ones but finds no room (blocks for its first chunk, or a
        sequence slot): the lowest-priority running sequences, newest first, give theirs back until it fits.
        Preempted by recomputation, they resume later with the tokens they had."""
        if not self.waiting or not self.running:
            return
        head, bm = self.waiting[0], self.block_manager
        while True:
            lower = [s for s in self.running if s.priority < head.priority]
            if not lower:
                return
            hits = bm.match_prefix(head)
            first_chunk = min(head.num_tokens - len(hits) * bm.block_size, self.config.max_num_batched_tokens)
            # Running sequences take their blocks for this step first: room that leaves them out goes to
            # their growth, and the urgent sequence waits another step (or several).
            growth = sum(bm.blocks_for(s.num_tokens) - len(s.block_table) for s in self.running)
            if len(self.running) < self.config.max_num_seqs and bm.can_admit(head, hits, first_chunk, reserve=growth):
                return
            victim = min(lower, key=lambda s: (s.priority, -s.seq_id))
            self.running.remove(victim)
            self._preempt(victim)
