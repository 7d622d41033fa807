"""One sequence's state. As in vLLM V1, there is no prefill or decode phase: a sequence just has
``num_computed_tokens`` catching up with ``len(token_ids)``; a step computes some of the gap."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.outputs import TokenLogprob
from sluice.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt, then output
    num_prompt_tokens: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None = None
    guide: Any = None  # sluice.engine.guided.Guide when the request asks for structured output
    think: Any = None  # sluice.engine.reasoning.ThinkState for a chat request to a reasoning model
    lora: str | None = None  # the LoRA adapter's name; None: the base model
    priority: int = 0  # higher first (Request.priority)
    images: list[Any] | None = None  # sluice.engine.vision.ImageItem of a chat request with images, in prompt order
    mrope: Any = None  # sluice.engine.mrope.MRopePositions: an M-RoPE model's prompt with images (else plain positions)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    admitted: bool = False  # once admitted: a re-admission after preemption finds its own blocks, not cache hits
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained prefix hash of each full block
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token, the first None
    arrival_time: float = field(default_factory=time.time)
    admitted_time: float | None = None  # first scheduled (a trace's engine admission)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
