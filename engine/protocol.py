"""What a caller of the engine may use (the worker, ``sluice generate``): requests in, completions out,
and the numbers an admission budget needs. ``engine.llm.LLM`` is the one implementation."""

from __future__ import annotations

from typing import Any, Protocol

from engine.config import EngineConfig
from engine.outputs import Completion, Request


class Engine(Protocol):
    config: EngineConfig
    tokenizer: Any  # a Hugging Face tokenizer: spells out logprob tokens and echoed prompts
    model_impl: str  # native | transformers, for the log
    device: Any  # a torch.device; named in the worker's default id

    @property
    def vocab_size(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_total_blocks(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def stats(self) -> dict[str, float]: ...

    def add_request(self, request: Request) -> None: ...
    def abort(self, request_id: str) -> Completion | None: ...
    def has_unfinished(self) -> bool: ...
    def step(self) -> list[Completion]: ...
