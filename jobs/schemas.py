"""The job plane's data: Batch, Job, SamplingParams, Result (pydantic v2, no torch here).

The line formats that become Jobs are read in jobs/lines.py; a Result's OpenAI batch output line is
rendered in jobs/openai_output.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)
from sluice.jobs.scoring import SCORE_KINDS, ScoreEntry, ScoreInput

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
JobKind = Literal["chat", "completion", "embedding", "score", "rerank"]
JobStatus = Literal["completed", "failed", "cancelled", "expired"]
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FINAL_BATCH_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})
# Batch metadata keys with this prefix are sluice's own: the API refuses them from a client, so no client
# can pass for what an older ``sluice submit`` wrote there (a dataset's source and row flags).
RESERVED_METADATA_PREFIX = "sluice_"
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


MAX_TOKENS = 1 << 20
MAX_TOKEN_ID = 2**31 - 1  # the vocabulary itself is checked when a worker admits the job
MAX_STOPS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_IDS = 1024
MAX_PROMPTS = 1024  # prompts in one completions request (OpenAI's list prompt)
MAX_PRIORITY = 1000  # |priority|; keys.stream_score keeps creation order exact within this range
MAX_TEMPLATE_KWARGS_CHARS = 100_000
MAX_DEADLINE = 1e11  # epoch seconds (year 5138): anything later is a unit mistake


class SamplingParams(BaseModel):
    """Mirrors ``sluice.engine.sampling_params.SamplingParams`` field for field (the worker maps one onto the other)."""

    # Frozen and hashable: identical settings are validated once and shared by many jobs.
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Every number bounded and finite, every list bounded: a value that validates must not crash a step.
    max_tokens: int = Field(256, ge=0, le=MAX_TOKENS)  # 0: score the prompt only (needs prompt_logprobs)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    temperature: float = Field(0.0, ge=0, le=100, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_TOKEN_ID)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # a torch generator takes 64 bits (+ sample index)
    repetition_penalty: float = Field(1.0, gt=0, le=100, allow_inf_nan=False)
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    stop: tuple[Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)], ...] = Field((), max_length=MAX_STOPS)
    stop_token_ids: tuple[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)], ...] = Field((), max_length=MAX_STOP_IDS)
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=128)
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # top-k per prompt token (echo + logprobs, vLLM's name)
    # Structured output, under vLLM's names (at most one); engine/guided.py enforces it.
    guided_json: str | None = None  # a JSON schema, serialized
    guided_json_object: bool = False
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] | None = None
    guided_grammar: str | None = None  # EBNF (with ::=) or Lark
    guided_prefix: str = ""  # literal text before / after the constrained part (a forced tool call's tags)
    guided_suffix: str = ""
    # Reasoning models: the most thinking tokens before the end-of-thinking token is forced.
    max_reasoning_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS)
    # Options for the chat template (vLLM's name), e.g. {"enable_thinking": false}; serialized, sorted keys.
    chat_template_kwargs: str | None = Field(None, max_length=MAX_TEMPLATE_KWARGS_CHARS)

    @field_validator("guided_json", mode="before")
    @classmethod
    def _schema_text(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return json.dumps(v, sort_keys=True)
        if isinstance(v, str):
            try:
                parsed = json.loads(v)
            except json.JSONDecodeError:
                raise ValueError("must be a JSON schema (an object, or its JSON text)") from None
            if not isinstance(parsed, dict):
                raise ValueError("must be a JSON schema (an object, or its JSON text)")
        return v

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _kwargs_text(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                raise ValueError("must be a JSON object") from None
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError("must be a JSON object")
        return json.dumps(v, sort_keys=True)

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop(cls, v: Any) -> Any:
        if v is None:
            return ()
        return (v,) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if self.n * self.max_tokens > MAX_TOKENS:  # the tokens one request may generate in all (n choices)
            raise ValueError(f"n x max_tokens is {self.n * self.max_tokens:,}; at most {MAX_TOKENS:,} tokens "
                             "per request in all")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens 0 (score the prompt only) needs echo with logprobs, or prompt_logprobs")
        given = [k for k in GUIDED_FIELDS if getattr(self, k) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"give at most one of {', '.join(GUIDED_FIELDS)} (got {', '.join(given)})")
        if self.guided_choice is not None and not self.guided_choice:
            raise ValueError("guided_choice must not be empty")
        if (self.guided_prefix or self.guided_suffix) and not given:
            raise ValueError("guided_prefix and guided_suffix need a guided_* constraint")
        return self


GUIDED_FIELDS = ("guided_json", "guided_json_object", "guided_regex", "guided_choice", "guided_grammar")


SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)


class Job(BaseModel):
    """One request of a batch. Exactly one of ``prompt``, ``prompt_token_ids``, ``prompts``, ``messages``."""

    model_config = ConfigDict(extra="forbid")

    id: str = ""  # "<batch_id>:<idx>" once submitted
    batch_id: str | None = None
    idx: int = 0  # position among the batch's valid jobs (0..total-1)
    line: int = 0  # 1-based input line number
    custom_id: str
    kind: JobKind = "chat"
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    # completions: several prompts (texts or token-id lists) in one request, as OpenAI's list prompt; the
    # worker runs one engine request per prompt and answers with all their choices (worker/convert.py)
    prompts: list[str | list[int]] | None = Field(None, min_length=2, max_length=MAX_PROMPTS)
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI's function tools, passed to the chat template
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "none" | "required" | {"type": "function", ...}
    echo: bool = False  # completions: the prompt's text leads the completion's
    # embedding jobs (/v1/embeddings): the body's input, checked by sluice.jobs.embeddings.check_input
    input: str | list[str] | list[int] | list[list[int]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    score: ScoreInput | None = None  # score and rerank jobs (/v1/score, /v1/rerank): jobs/scoring.py
    params: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = None
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # higher is pulled first
    deadline: float | None = Field(None, ge=0, le=MAX_DEADLINE, allow_inf_nan=False)  # epoch s: not started by then -> expired
    created_at: float = 0.0
    traceparent: str | None = None  # W3C trace context of its sluice.submit span (tracing on: jobs/tracing.py)
    api: Literal["responses"] | None = None  # the API whose shape its answer takes (None: its kind's own URL's)
    stream: bool | None = None  # an interactive request streaming its text (jobs/interactive.py); None: no
    max_deliveries: int | None = Field(None, ge=1)  # its batch's own (metadata sluice_max_deliveries); None: the worker's

    @model_validator(mode="after")
    def _one_input(self) -> Job:
        if (self.kind in SCORE_KINDS) != (self.score is not None):
            raise ValueError("score is for score and rerank jobs, and those need score")
        if self.score is not None:
            if any(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages, self.input)):
                raise ValueError("a score job takes score, not prompt, messages or input")
            return self
        if self.kind == "embedding" or self.input is not None:
            if self.kind != "embedding" or self.input is None:
                raise ValueError("input is for embedding jobs, and an embedding job needs input")
            if any(x is not None for x in (self.prompt, self.prompt_token_ids, self.prompts, self.messages)):
                raise ValueError("an embedding job takes input, not prompt or messages")
            return self
        given = sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.prompts, self.messages))
        if given != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids, prompts or messages")
        if self.prompts is not None and len(self.prompts) * self.params.n * self.params.max_tokens > MAX_TOKENS:
            raise ValueError(f"prompts x n x max_tokens is {len(self.prompts) * self.params.n * self.params.max_tokens:,}; "
                             f"at most {MAX_TOKENS:,} tokens per request in all")
        return self


class ErrorInfo(BaseModel):
    code: str
    message: str


class ResultUsage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those of the thinking (delimiters included)


class ResultTimings(BaseModel):
    """Epoch seconds of a job's life: submitted, pulled by a worker, first token, finished."""

    submitted: float | None = None
    started: float | None = None
    first_token: float | None = None
    finished: float | None = None


class TopLogprob(BaseModel):
    token_id: int
    token: str = ""
    logprob: float


class TokenLogprob(BaseModel):
    token_id: int
    token: str = ""
    logprob: float | None = None  # None only for a prompt's first token: nothing came before it (dropped by exclude_none)
    top: list[TopLogprob] = Field(default_factory=list)
    rank: int | None = None  # prompt tokens: 1 + how many tokens were likelier


class Choice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's shape; ``text`` is then what surrounds them
    reasoning: str | None = None  # a reasoning model's thinking; ``text`` is then only the answer
    prompt_logprobs: list[TokenLogprob] | None = None  # one per prompt token, the first's logprob None


class Result(BaseModel):
    """A job's one outcome. ``text``/``finish_reason`` are the first sample's; ``choices`` holds every
    sample, and is filled only when there are several or they carry logprobs or tool calls."""

    job_id: str
    custom_id: str
    batch_id: str | None = None
    idx: int = 0
    kind: JobKind = "chat"
    api: Literal["responses"] | None = None  # the job's (jobs/responses.py renders the answer)
    model: str | None = None
    status: JobStatus = "completed"
    text: str = ""
    finish_reason: str | None = None
    choices: list[Choice] = Field(default_factory=list)
    usage: ResultUsage = Field(default_factory=ResultUsage)
    timings: ResultTimings = Field(default_factory=ResultTimings)
    worker: str | None = None
    error: ErrorInfo | None = None
    # An embedding job's vectors, each as base64 little-endian float32 (exact, a third of the JSON
    # numbers' size); jobs/openai_output.py renders them in the job's encoding_format.
    embeddings: list[str] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    scores: list[ScoreEntry] | None = None  # a score or rerank job's (jobs/scoring.py renders them)


class BatchCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    invalid: int = 0  # input lines rejected at submission (never enqueued, not in total)

    @property
    def done(self) -> int:
        return self.completed + self.failed + self.cancelled + self.expired


class DeadLetter(BaseModel):
    """A job given up on after ``deliveries`` deliveries: an entry of its batch's dead-letter stream."""

    idx: int
    custom_id: str
    error: str  # the last error
    deliveries: int
    worker: str  # the worker that gave up
    job: dict[str, Any]  # the Job as queued, to resubmit


class LineErrorInfo(BaseModel):
    line: int
    code: str
    message: str
    custom_id: str | None = None  # when the caller knows it (a Message Batch's results name every request)


class Batch(BaseModel):
    """A batch's status, with OpenAI's state names and timestamps (epoch seconds)."""

    id: str
    model: str
    status: BatchStatus
    endpoint: str = CHAT_URL  # the URL every request of the batch is for (OpenAI's batch ``endpoint``)
    counts: BatchCounts = Field(default_factory=BatchCounts)
    priority: int = 0
    input: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    # The dataset the batch's lines were rendered from (source URL and row flags), as ``sluice submit``
    # wrote it: apart from ``metadata`` (a client's), and never shown by the API.
    dataset: dict[str, Any] | None = None
    created_at: float
    in_progress_at: float | None = None
    expires_at: float | None = None
    finalizing_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    expired_at: float | None = None
    cancelling_at: float | None = None
    cancelled_at: float | None = None
    errors: list[LineErrorInfo] = Field(default_factory=list)  # the first few bad lines
    usage: ResultUsage = Field(default_factory=ResultUsage)  # summed over completed jobs
    completion_window: str = "24h"  # as submitted
    output_expires_after: float | None = None  # seconds the output and error files live after creation
    paused_at: float | None = None  # set while paused (jobs/pause.py): no new job of it is handed out

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_BATCH_STATUSES

    def to_openai(self, endpoint: str | None = None) -> dict[str, Any]:
        """The OpenAI Batch object (integer timestamps; cancelled/expired requests count as failed)."""
        c = self.counts
        ts = {k: _int_or_none(getattr(self, k)) for k in (
            "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
            "cancelling_at", "cancelled_at")}
        errors = [{"code": e.code, "message": e.message, "line": e.line, "param": None} for e in self.errors]
        return {
            "id": self.id, "object": "batch", "endpoint": endpoint or self.endpoint, "model": self.model,
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": self.input or "", "completion_window": self.completion_window, "status": self.status,
            "output_file_id": None, "error_file_id": None, "created_at": int(self.created_at), **ts,
            "request_counts": {"total": c.total, "completed": c.completed,
                               "failed": c.failed + c.cancelled + c.expired},
            "metadata": self.metadata or None,
            # Sluice's own (OpenAI has no paused status, so ``status`` stays one of OpenAI's).
            "paused": self.paused_at is not None, "paused_at": _int_or_none(self.paused_at),
            "usage": {"input_tokens": self.usage.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": self.usage.cached_tokens},
                      "output_tokens": self.usage.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": self.usage.reasoning_tokens},
                      "total_tokens": self.usage.prompt_tokens + self.usage.completion_tokens},
        }


def _int_or_none(x: float | None) -> int | None:
    return None if x is None else int(x)


class WorkerHeartbeat(BaseModel):
    """What a live worker says of itself each beat (keys.heartbeat): written by its consumer session
    (the engine's side from worker/worker.py), read by jobs/store.list_workers for the API, /metrics,
    the dashboard and the CLI. Defaults are what an older worker's heartbeat without the field means."""

    model_config = ConfigDict(extra="ignore")  # a newer worker's fields do not break an older reader

    id: str
    host: str = ""
    pid: int = 0
    queue: str | None = None  # None: the default queue
    time: float = 0.0  # when it was written (unix seconds)
    held: int = 0  # jobs the worker holds
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0  # KV cache blocks
    total_blocks: int = 0
    draining: bool = False
    serves: Literal["generation", "embedding", "score"] = "generation"
    quantization: str = "none"
    parallelism: str = "one device"
    adapters: list[str] = Field(default_factory=list)  # LoRA adapters served without a lookup
    lora_roots: bool = False  # loads adapters named by lines from --lora-root
    prompt_tokens: int = 0  # since it started; cached_tokens of them served by the prefix cache
    cached_tokens: int = 0
    unwritten: int = 0  # results waiting in its outbox
    writes_held_since: float | None = None  # the server refuses its writes (full) since then
    write_error: str | None = None

    @property
    def queue_name(self) -> str:
        return self.queue or "default"

    @classmethod
    def read(cls, value: str | bytes | None) -> WorkerHeartbeat | None:
        """A heartbeat key's value; None when absent or not a heartbeat (a stray key must not break a
        listing of the live workers)."""
        if value is None:
            return None
        try:
            return cls.model_validate_json(value)
        except ValidationError:
            return None
