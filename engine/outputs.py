"""What the engine hands back: a request in, a Completion out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.engine.sampling_params import SamplingParams


@dataclass
class Request:
    """One generation request. Give ``prompt_token_ids``, a ``prompt`` string, or chat ``messages``."""

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams = field(default_factory=SamplingParams)
    tools: list[dict[str, Any]] | None = None  # chat: function tools, passed to the chat template
    chat_template_kwargs: dict[str, Any] | None = None  # chat: more template options (enable_thinking, ...)
    lora: str | None = None  # a LoRA adapter the engine was started with (EngineConfig.lora_modules); None: the base
    # Higher first: waits ahead of lower ones and, when the KV cache or the sequence slots are full, takes
    # them from running lower-priority sequences (which are preempted and resume later, recomputed).
    priority: int = 0


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


@dataclass
class Timings:
    """Wall-clock times (time.time()) of a request's life."""

    queued: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    admitted: float | None = None  # first scheduled by the engine


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-k (token_id, logprob) at that step
    rank: int | None = None  # prompt logprobs: 1 + how many tokens were likelier


@dataclass
class CompletionOutput:
    """One sample of a request (``n > 1`` gives several)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort | error (a structured output ends in "stop" once complete)
    logprobs: list[TokenLogprob] | None = None
    # A reasoning model's chat reply (engine/reasoning.py): ``text`` is then only the answer.
    reasoning: str | None = None  # the thinking, without its delimiters; None when the model did not think
    reasoning_tokens: int = 0  # output tokens of the thinking, delimiters included


@dataclass
class Completion:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    usage: Usage
    timings: Timings
    error: str | None = None  # set when finish_reason is "error" (e.g. the request can never fit)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # params.prompt_logprobs: one per prompt token

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason if self.outputs else "error"
