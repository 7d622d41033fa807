"""The embedding engine's front door, shaped like engine/llm.py's for generation: ``add_request``,
``step`` (one forward pass; returns the requests it finished), ``abort``, ``has_unfinished``.

A request is one ``/v1/embeddings`` body's ``input``: a string, a list of strings, a list of token ids
or a list of such lists; it finishes when all of its inputs have a vector, in input order.

Too long an input: ``truncate=True`` (the default, and sentence-transformers' behaviour) keeps its
first ``max_len`` tokens (for text, the tokenizer's own truncation, so special tokens stay);
``truncate=False`` fails the request with a clear error. ``usage.prompt_tokens`` counts the tokens
embedded (after truncation). A request that is malformed (empty input, bad token ids, ``dimensions``
the model does not allow) comes back from the next ``step()`` with ``error`` set; nothing else is
affected.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from sluice.engine.embedding_model import EmbeddingModel, load_embedding_model
from sluice.engine.intake import Intake
from sluice.engine.outputs import Timings
from sluice.engine.pooling import finish_vector
from sluice.engine.pooling_runner import Item, LengthPool, run_batch

log = logging.getLogger(__name__)

EmbeddingInput = str | list[str] | list[int] | list[list[int]]
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EmbeddingConfig:
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str = "cpu"
    max_num_seqs: int = 256  # inputs in one forward pass at most
    # Padded tokens (batch * longest) in one forward pass. On all-MiniLM-L6-v2 (one thread, CPU time)
    # 2,048-token passes ran about 5% more tokens per CPU-second than 8,192-token ones.
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_seq_length
    truncate: bool = True  # an input over max_model_len: keep its head (True) or fail the request (False)
    pooling: str | None = None  # a plain transformers directory's pooling (mean | cls | max | lasttoken)
    matryoshka: bool | None = None  # None = as the model's config says
    cpu_linear: str = "auto"  # auto (oneDNN-packed where it runs) | aten | onednn-packed
    cpu_attention: str = "auto"  # auto (engine/encoder_attention.py's op where it runs) | sdpa | varlen
    # What a worker may hold waiting, in tokens (None = 4 forward passes' worth): no KV cache here, so
    # this is the capacity the worker's puller sees, counted in blocks of ``block_size`` tokens.
    max_waiting_tokens: int | None = None
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, not {self.dtype!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass
class EmbeddingRequest:
    request_id: str
    input: EmbeddingInput
    dimensions: int | None = None  # Matryoshka: the first ``dimensions`` components, re-normalised
    truncate: bool | None = None  # None = the engine's setting


@dataclass
class EmbeddingOutput:
    request_id: str
    embeddings: list[list[float]]  # one per input, in input order (empty on error or abort)
    prompt_tokens: int
    num_truncated: int  # inputs cut to max_model_len
    timings: Timings
    finish_reason: str = "stop"  # stop | abort | error
    error: str | None = None


@dataclass
class _RequestState:
    request: EmbeddingRequest
    items: list[Item]
    vectors: list[list[float] | None]
    num_truncated: int
    arrival: float
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = len(self.items)


class EmbeddingEngine(Intake[_RequestState, EmbeddingOutput]):
    """``EmbeddingEngine(model, **config)``: see ``EmbeddingConfig`` for the settings."""

    serves = "embedding"  # sluice.engine.llm.LLM serves generation (a worker's heartbeat says which)
    # engine/protocol.py's rest, as the LLM has them: an embedding model loads unquantized on one device, no LoRA
    quantization = "none"
    parallelism = "one device"
    lora = None

    def __init__(self, model: str, **config: Any) -> None:
        super().__init__()
        self.config = EmbeddingConfig(**config)
        self.model: EmbeddingModel = self._load(model)
        self.tokenizer = self.model.tokenizer
        self.model_impl = "transformers"
        self.device = torch.device(self.config.device)
        self.capacity_tokens = self.config.max_waiting_tokens or 4 * self.config.max_num_batched_tokens
        self.max_model_len = min(self.model.max_len, self.config.max_model_len or self.model.max_len)
        self.dimension = self.model.pooling.dimension
        self.pool = LengthPool()
        self._seqs = itertools.count()
        self.num_steps = 0
        self.num_padded_tokens = 0  # batch * longest, summed over steps
        self.num_tokens = 0  # real tokens embedded
        log.info("embedding model %s: %s pooling%s, %d dims, max %d tokens, %s linear layers, %s attention",
                 self.model.path.name,
                 self.model.pooling.mode, " + normalize" if self.model.pooling.normalize else "",
                 self.dimension, self.max_model_len, self.model.cpu_linear, self.model.attention)

    def _load(self, model: str) -> EmbeddingModel:
        c = self.config
        return load_embedding_model(model, _DTYPES[c.dtype], c.device, c.pooling, c.matryoshka, c.cpu_linear,
                                    c.cpu_attention)

    # ---- the numbers a puller needs -------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        """Requests none of whose inputs has run yet."""
        return sum(1 for s in self.requests.values() if s.left == len(s.items))

    @property
    def num_running(self) -> int:
        """Requests partly embedded (a long list of inputs spans several steps)."""
        return len(self.requests) - self.num_waiting

    @property
    def num_waiting_tokens(self) -> int:
        return self.pool.num_tokens

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    # A worker's puller admits by free KV blocks; here a "block" is ``block_size`` tokens of the
    # capacity, less the tokens already waiting to be embedded.
    @property
    def num_total_blocks(self) -> int:
        return self.capacity_tokens // self.config.block_size

    @property
    def num_free_blocks(self) -> int:
        return max(0, self.capacity_tokens - self.num_waiting_tokens) // self.config.block_size

    @property
    def stats(self) -> dict[str, float]:
        return {"steps": self.num_steps, "tokens": self.num_tokens, "padded_tokens": self.num_padded_tokens,
                "padding_share": 1 - self.num_tokens / self.num_padded_tokens if self.num_padded_tokens else 0.0}

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request: EmbeddingRequest) -> None:
        arrival = time.time()
        try:
            self._check_new(request.request_id)
            self._check_dimensions(request.dimensions)
            truncate = self.config.truncate if request.truncate is None else request.truncate
            ids, cut = self._tokenize(request.input, truncate)
        except ValueError as e:
            self._reject(_error_output(request.request_id, str(e), arrival))
            return
        items = [Item(next(self._seqs), request.request_id, i, t) for i, t in enumerate(ids)]
        self.requests[request.request_id] = _RequestState(request, items, [None] * len(items), cut, arrival)
        for it in items:
            self.pool.add(it)

    def abort(self, request_id: str) -> EmbeddingOutput | None:
        """Drop a request now; returns it as aborted (no vectors), or None if it is not here."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for it, vec in zip(state.items, state.vectors, strict=True):
            if vec is None:
                self.pool.remove(it)
        return EmbeddingOutput(request_id, [], _num_tokens(state), state.num_truncated,
                               Timings(state.arrival, None, time.time()), "abort")

    def step(self) -> list[EmbeddingOutput]:
        """One forward pass over a batch of waiting inputs; returns the requests it finished."""
        done = self._take_rejected()
        batch = self.pool.take_batch(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        if not batch:
            return done
        pooled = run_batch(self.model, batch)
        self.num_steps += 1
        self.num_tokens += sum(len(it.token_ids) for it in batch)
        self.num_padded_tokens += len(batch) * max(len(it.token_ids) for it in batch)
        now = time.time()
        for it, vec in zip(batch, self._finish_vectors(batch, pooled), strict=True):
            state = self.requests[it.request_id]
            state.vectors[it.index] = vec
            state.left -= 1
            if state.left == 0:
                del self.requests[it.request_id]
                done.append(EmbeddingOutput(it.request_id, state.vectors, _num_tokens(state),  # type: ignore[arg-type]
                                            state.num_truncated, Timings(state.arrival, now, now)))
        return done

    def embed(self, requests: Iterable[EmbeddingRequest]) -> list[EmbeddingOutput]:
        """Run requests to completion; results in input order."""
        order = []
        for r in requests:
            self.add_request(r)
            order.append(r.request_id)
        results: dict[str, EmbeddingOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                results[out.request_id] = out
        return [results[rid] for rid in order]

    # ---- internals ------------------------------------------------------------------------------
    def _finish_vectors(self, batch: list[Item], pooled: torch.Tensor) -> list[list[float]]:
        dims = [self.requests[it.request_id].request.dimensions for it in batch]
        norm = self.model.pooling.normalize
        if all(d is None for d in dims):
            return finish_vector(pooled, norm, None).tolist()
        return [finish_vector(v, norm, d).tolist() for v, d in zip(pooled, dims, strict=True)]

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.dimension:
            return
        p = self.model.pooling
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= self.dimension:
            raise ValueError(f"dimensions must be an integer from 1 to {self.dimension}, not {dimensions!r}")
        if not p.matryoshka:
            raise ValueError(f"this model ({self.model.path.name}) was not trained for shortened vectors "
                             "(Matryoshka): dimensions cannot be set")
        if p.matryoshka_dimensions and dimensions not in p.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(p.matryoshka_dimensions)} for this model, "
                             f"not {dimensions}")

    def _tokenize(self, inp: EmbeddingInput, truncate: bool) -> tuple[list[list[int]], int]:
        """The input's token id lists, each within max_model_len, and how many were cut."""
        texts, ids = _split_input(inp)
        if texts is not None and self.model.pooling.default_prompt:
            texts = [self.model.pooling.default_prompt + t for t in texts]
        if texts is not None:
            # One token past the limit tells a long text apart without tokenizing all of a huge one.
            ids = self._encode(texts, self.max_model_len + 1)
        assert ids is not None
        out, cut = [], 0
        for i, t in enumerate(ids):
            if not t:
                raise ValueError(f"input[{i}] is empty" if len(ids) > 1 else "the input is empty")
            if len(t) > self.max_model_len:
                if not truncate:
                    raise ValueError(f"input[{i}] has more tokens than this model takes ({self.max_model_len}); "
                                     "shorten it or allow truncation")
                cut += 1
                t = self._encode([texts[i]], self.max_model_len)[0] if texts is not None else t[: self.max_model_len]
            out.append(list(t))
        vocab = self.model.vocab_size
        if texts is None and any(min(t) < 0 or max(t) >= vocab for t in out):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return out, cut

    def _encode(self, texts: list[str], max_length: int) -> list[list[int]]:
        # The tokenizer's own truncation keeps the special tokens ([CLS] ... [SEP]) around the head.
        return self.tokenizer(texts, add_special_tokens=True, truncation=True, max_length=max_length)["input_ids"]


def _split_input(inp: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """``input`` as (texts, None) or (None, token id lists); a ValueError names what is wrong."""
    if isinstance(inp, str):
        if not inp:
            raise ValueError("the input is an empty string")
        return [inp], None
    if not isinstance(inp, list) or not inp:
        raise ValueError("input must be a string, a list of strings, a list of token ids or a list of such lists, "
                         "and not empty")
    if all(isinstance(x, str) for x in inp):
        empty = [i for i, x in enumerate(inp) if not x]
        if empty:  # a tokenizer would still give [CLS] [SEP]; OpenAI refuses it, and so do we
            raise ValueError(f"input[{empty[0]}] is an empty string")
        return list(inp), None
    if all(_is_int(x) for x in inp):
        return None, [list(inp)]
    if all(isinstance(x, list) and all(_is_int(y) for y in x) for x in inp):
        return None, [list(x) for x in inp]
    raise ValueError("input must be a string, a list of strings, a list of token ids or a list of such lists")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num_tokens(state: _RequestState) -> int:
    return sum(len(it.token_ids) for it in state.items)


def _error_output(request_id: str, message: str, arrival: float) -> EmbeddingOutput:
    return EmbeddingOutput(request_id, [], 0, 0, Timings(arrival, None, time.time()), "error", message)
