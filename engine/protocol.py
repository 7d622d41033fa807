"""What a caller of the engine may use (the worker, ``sluice generate``): requests in, completions out,
and the numbers an admission budget needs. ``sluice.engine.llm.LLM`` is the one implementation."""

from __future__ import annotations

from typing import Any, Protocol

from sluice.engine.config import EngineConfig
from sluice.engine.outputs import Completion, Request


class Engine(Protocol):
    config: EngineConfig
    tokenizer: Any  # a Hugging Face tokenizer: spells out logprob tokens and echoed prompts
    model_impl: str  # native | transformers, for the log
    device: Any  # a torch.device; named in the worker's default id
    serves: str  # generation | embedding | score (worker/kinds.py: which jobs it runs)
    quantization: str  # the weights' method (engine/quant/methods.py), "none"
    lora: Any  # engine/lora/cache.py's adapters it serves, or None

    @property
    def parallelism(self) -> str: ...  # "one device" or "tensor parallel N (backend)"
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
    def tokens_so_far(self, request_id: str) -> tuple[int, list[list[int]]] | None: ...
    def step(self) -> list[Completion]: ...
