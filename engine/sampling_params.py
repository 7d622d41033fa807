"""Per-request sampling settings (plain dataclass; the job schemas in ``jobs/`` map onto it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # the same seed gives the same text whatever shares the batch
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)  # stop strings, excluded from the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # samples sharing the prompt's KV blocks
    logprobs: int | None = None  # top-k logprobs per generated token
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (engine/prompt_logprobs.py)
    # Structured output (engine/guided.py), at most one of the five; vLLM's names.
    guided_json: str | None = None  # a JSON schema, serialized (a dict is serialized here)
    guided_json_object: bool = False  # any JSON object (response_format json_object)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # EBNF (GBNF, with ::=) or Lark
    # Literal text around the constrained part (a tool call's <tool_call> tags); only with one of the above.
    guided_prefix: str = ""
    guided_suffix: str = ""
    # Reasoning models (engine/reasoning.py): past this many thinking tokens, the end of thinking is forced.
    max_reasoning_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.guided_json, dict | bool):
            self.guided_json = json.dumps(self.guided_json)
        guided = [self.guided_json is not None, self.guided_json_object, self.guided_regex is not None,
                  self.guided_choice is not None, self.guided_grammar is not None]
        checks = [
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be between 0 and max_tokens"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.n >= 1, "n must be >= 1"),
            (self.max_reasoning_tokens is None or self.max_reasoning_tokens >= 0, "max_reasoning_tokens must be >= 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs must be in [0, 20]"),
            (sum(guided) <= 1, "give at most one of guided_json, guided_json_object, guided_regex, guided_choice "
                               "and guided_grammar"),
            (self.guided_choice is None or len(self.guided_choice) > 0, "guided_choice must not be empty"),
            (any(guided) or not (self.guided_prefix or self.guided_suffix),
             "guided_prefix and guided_suffix need a guided_* constraint"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
