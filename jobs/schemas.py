"""The job plane's data: Batch, Job, SamplingParams, Result (pydantic v2, no torch here).

Also the two line formats the CLI, the API and ``submit`` read (OpenAI batch lines and simple
``{"prompt"|"messages", ...}`` lines) and the OpenAI batch output line a Result renders to.
"""

from __future__ import annotations

import functools
import json
from datetime import UTC, datetime
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

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
JobKind = Literal["chat", "completion"]
JobStatus = Literal["completed", "failed", "cancelled", "expired"]
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
FINAL_BATCH_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


MAX_TOKENS = 1 << 20
MAX_TOKEN_ID = 2**31 - 1  # the vocabulary itself is checked when a worker admits the job
MAX_STOPS = 16
MAX_STOP_CHARS = 1000
MAX_STOP_IDS = 1024
MAX_PRIORITY = 1000  # |priority|; keys.stream_score keeps creation order exact within this range
MAX_DEADLINE = 1e11  # epoch seconds (year 5138): anything later is a unit mistake


class SamplingParams(BaseModel):
    """Mirrors ``engine.sampling_params.SamplingParams`` field for field (the worker maps one onto the other)."""

    # Frozen and hashable: identical settings are validated once and shared by many jobs.
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Every number bounded and finite, every list bounded: a value that validates must not crash a step.
    max_tokens: int = Field(256, ge=1, le=MAX_TOKENS)
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
    # Structured output, under vLLM's names (at most one); engine/guided.py enforces it.
    guided_json: str | None = None  # a JSON schema, serialized
    guided_json_object: bool = False
    guided_regex: str | None = None
    guided_choice: tuple[str, ...] | None = None
    guided_grammar: str | None = None  # EBNF (with ::=) or Lark
    guided_prefix: str = ""  # literal text before / after the constrained part (a forced tool call's tags)
    guided_suffix: str = ""

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
_DEFAULT_PARAMS = SamplingParams()


class Job(BaseModel):
    """One request of a batch. Exactly one of ``prompt``, ``prompt_token_ids``, ``messages``."""

    model_config = ConfigDict(extra="forbid")

    id: str = ""  # "<batch_id>:<idx>" once submitted
    batch_id: str | None = None
    idx: int = 0  # position among the batch's valid jobs (0..total-1)
    line: int = 0  # 1-based input line number
    custom_id: str
    kind: JobKind = "chat"
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI's function tools, passed to the chat template
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "none" | "required" | {"type": "function", ...}
    echo: bool = False  # completions: the prompt's text leads the completion's
    params: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = None
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)  # higher is pulled first
    deadline: float | None = Field(None, ge=0, le=MAX_DEADLINE, allow_inf_nan=False)  # epoch s: not started by then -> expired
    created_at: float = 0.0

    @model_validator(mode="after")
    def _one_input(self) -> Job:
        given = sum(x is not None for x in (self.prompt, self.prompt_token_ids, self.messages))
        if given != 1:
            raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
        return self


class ErrorInfo(BaseModel):
    code: str
    message: str


class ResultUsage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


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
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class Choice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's shape; ``text`` is then what surrounds them


class Result(BaseModel):
    """A job's one outcome. ``text``/``finish_reason`` are the first sample's; ``choices`` holds every
    sample, and is filled only when there are several or they carry logprobs or tool calls."""

    job_id: str
    custom_id: str
    batch_id: str | None = None
    idx: int = 0
    kind: JobKind = "chat"
    model: str | None = None
    status: JobStatus = "completed"
    text: str = ""
    finish_reason: str | None = None
    choices: list[Choice] = Field(default_factory=list)
    usage: ResultUsage = Field(default_factory=ResultUsage)
    timings: ResultTimings = Field(default_factory=ResultTimings)
    worker: str | None = None
    error: ErrorInfo | None = None


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


class LineErrorInfo(BaseModel):
    line: int
    code: str
    message: str


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
            "usage": {"input_tokens": self.usage.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": self.usage.cached_tokens},
                      "output_tokens": self.usage.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.usage.prompt_tokens + self.usage.completion_tokens},
        }


def _int_or_none(x: float | None) -> int | None:
    return None if x is None else int(x)


# ---- parsing one input line ----------------------------------------------------------------------
class LineError(ValueError):
    """A bad input line; ``str()`` names the line."""

    def __init__(self, line: int, code: str, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.code = code
        self.message = message

    def info(self) -> LineErrorInfo:
        return LineErrorInfo(line=self.line, code=self.code, message=self.message)


# Body fields OpenAI accepts that change nothing here (or only when left at their no-op value).
_IGNORED_BODY = frozenset({"model", "user", "metadata", "store", "service_tier", "parallel_tool_calls"})
_NOOP_BODY: dict[str, Any] = {"stream": (False, None), "logit_bias": (None, {}), "suffix": (None, "")}
# Extensions to OpenAI's body that vLLM also takes, under the engine's names.
_EXTRA_BODY = frozenset({"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids"})
_OPENAI_SAMPLING = frozenset({"temperature", "top_p", "n", "stop", "seed", "presence_penalty",
                              "frequency_penalty", "max_tokens"}) | _EXTRA_BODY
# Structured output in a body or a simple line: OpenAI's response_format and vLLM's guided_* names.
_STRUCTURED = frozenset({"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                         "guided_json_object", "guided_decoding_backend", "guided_whitespace_pattern"})
_TOOLS = frozenset({"tools", "tool_choice"})
_SIMPLE_META = frozenset({"custom_id", "prompt", "prompt_token_ids", "messages", "model", "priority", "deadline",
                          "response_format", "tools", "tool_choice", "echo"})


def parse_line(text: str, line_no: int, defaults: SamplingParams | None = None, *,
               batch_id: str | None = None, idx: int = 0, created_at: float = 0.0) -> Job:
    """One input line (OpenAI batch or simple) -> Job; raises LineError naming ``line_no``. A line read
    with ``errors="surrogateescape"`` that was not UTF-8 is rejected as such."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise LineError(line_no, "invalid_encoding", f"not UTF-8 (character {e.start + 1})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise LineError(line_no, "invalid_json", f"not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise LineError(line_no, "invalid_line", "a line must be a JSON object")
    try:
        if "body" in obj or "url" in obj or "method" in obj:
            fields, sampling = _openai_fields(obj)
        else:
            fields, sampling = _simple_fields(obj, line_no)
        params = _merge_params(defaults, sampling)
        job_id = f"{batch_id}:{idx}" if batch_id else ""
        return Job(id=job_id, batch_id=batch_id, idx=idx, line=line_no, params=params, created_at=created_at,
                   **fields)
    except ValidationError as e:
        raise LineError(line_no, "invalid_request", _describe(e)) from None
    except ValueError as e:
        raise LineError(line_no, "invalid_request", str(e)) from None


def _merge_params(defaults: SamplingParams | None, sampling: dict[str, Any]) -> SamplingParams:
    if not sampling:
        return defaults if defaults is not None else _DEFAULT_PARAMS
    try:
        key = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in sampling.items()))
        hash(key)
    except TypeError:  # an unhashable value: let validation say what is wrong with it
        return _validate_params(defaults, sampling)
    return _cached_params(defaults, key)


@functools.lru_cache(maxsize=1024)
def _cached_params(defaults: SamplingParams | None, key: tuple[tuple[str, Any], ...]) -> SamplingParams:
    return _validate_params(defaults, dict(key))


def _validate_params(defaults: SamplingParams | None, sampling: dict[str, Any]) -> SamplingParams:
    base = defaults.model_dump(exclude_defaults=True) if defaults is not None else {}
    return SamplingParams.model_validate({**base, **sampling})


def _describe(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(x) for x in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def _openai_fields(obj: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    unknown = set(obj) - {"custom_id", "method", "url", "body"}
    if unknown:
        raise ValueError(f"unknown field {sorted(unknown)[0]!r} (want custom_id, method, url, body)")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method must be POST, not {obj.get('method')!r}")
    url = obj.get("url")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    if url == CHAT_URL:
        fields, sampling = _chat_body(body)
    elif url == COMPLETIONS_URL:
        fields, sampling = _completions_body(body)
    else:
        raise ValueError(f"url must be {CHAT_URL} or {COMPLETIONS_URL}, not {url!r}")
    fields["custom_id"] = custom_id
    if isinstance(body.get("model"), str):
        fields["model"] = body["model"]
    return fields, sampling


def _check_body_keys(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for k, v in body.items():
        if k in allowed or k in _IGNORED_BODY:
            continue
        if k in _NOOP_BODY and v in _NOOP_BODY[k]:
            continue
        raise ValueError(f"body.{k} is not supported" if k in _NOOP_BODY else f"unknown body field {k!r}")


def _chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    _check_body_keys(body, _OPENAI_SAMPLING | _STRUCTURED | _TOOLS | {"messages", "max_completion_tokens",
                                                                       "logprobs", "top_logprobs"})
    sampling = {k: v for k, v in body.items() if k in _OPENAI_SAMPLING and v is not None}
    if body.get("max_completion_tokens") is not None:
        sampling["max_tokens"] = body["max_completion_tokens"]
    if body.get("logprobs"):
        sampling["logprobs"] = body.get("top_logprobs") or 0
    fields = {"kind": "chat", "messages": normalize_messages(body.get("messages"))}
    _add_structured(body, fields, sampling, "body.")
    return fields, sampling


def _completions_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    _check_body_keys(body, _OPENAI_SAMPLING | _STRUCTURED | {"prompt", "logprobs", "best_of", "echo"})
    if body.get("best_of") not in (None, body.get("n", 1)):
        raise ValueError("body.best_of other than n is not supported")
    sampling = {k: v for k, v in body.items() if k in _OPENAI_SAMPLING and v is not None}
    if body.get("logprobs") is not None:
        sampling["logprobs"] = body["logprobs"]
    fields = {"kind": "completion", **_completion_prompt(body.get("prompt"))}
    _add_structured(body, fields, sampling, "body.")
    return fields, sampling


def _add_structured(obj: dict[str, Any], fields: dict[str, Any], sampling: dict[str, Any], where: str) -> None:
    """response_format, vLLM's guided_* fields, tools and echo of a body or simple line, into the job's
    fields and its sampling settings."""
    for k in GUIDED_FIELDS:
        if obj.get(k) is not None:
            sampling[k] = obj[k]
    if obj.get("guided_decoding_backend") not in (None, "xgrammar", "auto"):
        raise ValueError(f"{where}guided_decoding_backend: only xgrammar runs here")
    sampling.update(_response_format(obj.get("response_format"), where))
    if obj.get("tools") or obj.get("tool_choice") not in (None, "none", "auto"):
        if fields["kind"] != "chat":
            raise ValueError(f"{where}tools need chat messages")
        tools, choice, forced = _tools(obj.get("tools"), obj.get("tool_choice"), where)
        fields.update(tools=tools, tool_choice=choice)
        if forced:
            if any(k.startswith("guided_") for k in sampling):
                raise ValueError(f"{where}tool_choice {choice!r} forces a tool call: no response_format with it")
            sampling.update(forced)
    if obj.get("echo"):
        if fields["kind"] != "completion":
            raise ValueError(f"{where}echo is for completions (a prompt), not chat")
        if obj.get("logprobs") is not None:
            raise ValueError(f"{where}echo with logprobs (the prompt's logprobs) is not supported")
        fields["echo"] = True


def _response_format(fmt: Any, where: str) -> dict[str, Any]:
    if fmt is None:
        return {}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"guided_json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError(f"{where}response_format.json_schema.schema must be a JSON schema object")
        return {"guided_json": spec["schema"]}
    raise ValueError(f"{where}response_format.type must be text, json_object or json_schema")


# The Hermes / Qwen tool-call format: the JSON call between these tags, one block per call.
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


def _tools(tools: Any, choice: Any, where: str) -> tuple[list[dict[str, Any]], Any, dict[str, Any]]:
    """Checked tools, the tool_choice, and the sampling fields that force a call (empty unless forced)."""
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where}tool_choice {choice!r} needs tools")
    by_name: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"{where}tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ValueError(f"{where}tools[{i}].function.parameters must be a JSON schema object")
        by_name[fn["name"]] = params
    choice = "auto" if choice is None else choice
    if choice in ("auto", "none"):
        return tools, choice, {}
    if choice == "required":
        names = list(by_name)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in by_name:
            raise ValueError(f"{where}tool_choice names {name!r}, which is not among the tools")
        names = [name]
    else:
        raise ValueError(f"{where}tool_choice must be auto, none, required or {{'type': 'function', ...}}")
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": by_name[n]},
              "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return tools, choice, {"guided_json": schema, "guided_prefix": TOOL_CALL_OPEN + "\n",
                           "guided_suffix": "\n" + TOOL_CALL_CLOSE}


def _completion_prompt(prompt: Any) -> dict[str, Any]:
    # OpenAI also takes a list of one prompt (string or token ids); several prompts per line would
    # need several results per custom_id, so they are refused.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise ValueError("prompt must be a string or a list of token ids (one prompt per line)")


def _simple_fields(obj: dict[str, Any], line_no: int) -> tuple[dict[str, Any], dict[str, Any]]:
    unknown = set(obj) - _SIMPLE_META - SAMPLING_FIELDS - _STRUCTURED
    if unknown:
        raise ValueError(f"unknown field {sorted(unknown)[0]!r}")
    custom_id = obj.get("custom_id", f"line-{line_no}")
    if isinstance(custom_id, int) and not isinstance(custom_id, bool):
        custom_id = str(custom_id)
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    fields: dict[str, Any] = {"custom_id": custom_id}
    if "messages" in obj:
        fields.update(kind="chat", messages=normalize_messages(obj["messages"]))
    elif "prompt" in obj or "prompt_token_ids" in obj:
        fields.update(kind="completion", **_completion_prompt(obj.get("prompt", obj.get("prompt_token_ids"))))
    else:
        raise ValueError("a line needs prompt or messages")
    for k in ("model", "priority"):
        if obj.get(k) is not None:
            fields[k] = obj[k]
    if obj.get("deadline") is not None:
        fields["deadline"] = parse_deadline(obj["deadline"])
    sampling = {k: v for k, v in obj.items() if k in SAMPLING_FIELDS and v is not None}
    _add_structured(obj, fields, sampling, "")
    return fields, sampling


def parse_deadline(v: Any) -> float:
    """Epoch seconds, or an ISO-8601 time (one without a zone is taken as UTC)."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        t = float(v)
    elif isinstance(v, str):
        d = datetime.fromisoformat(v)
        t = (d if d.tzinfo else d.replace(tzinfo=UTC)).timestamp()
    else:
        raise ValueError("deadline must be epoch seconds or an ISO-8601 time")
    if not 0 <= t <= MAX_DEADLINE:  # NaN fails this too
        raise ValueError(f"deadline must be epoch seconds between 0 and {MAX_DEADLINE:.0f}")
    return t


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """Check chat messages; text parts are joined into one string (the chat template wants strings)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] needs a role in {sorted(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            content = _text_parts(content, i)
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            content = ""  # an assistant turn that only calls tools
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or text parts")
        msg: dict[str, Any] = {"role": "system" if m["role"] == "developer" else m["role"], "content": content}
        if m.get("tool_calls"):
            msg["tool_calls"] = _input_tool_calls(m["tool_calls"], i)
        for k in ("tool_call_id", "name"):
            if isinstance(m.get(k), str):
                msg[k] = m[k]
        out.append(msg)
    return out


def _input_tool_calls(calls: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool calls as chat templates read them (arguments as an object)."""
    if not isinstance(calls, list):
        raise ValueError(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"messages[{i}].tool_calls[{j}] needs function.name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise ValueError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
        call = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(c.get("id"), str):
            call["id"] = c["id"]
        out.append(call)
    return out


def _text_parts(parts: list[Any], i: int) -> str:
    texts = []
    for p in parts:
        if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise ValueError(f"messages[{i}].content: only text parts are supported")
        texts.append(p["text"])
    return "".join(texts)


# ---- rendering a Result as an OpenAI batch output line -----------------------------------------
_BATCH_ERROR_CODES = {"cancelled": "batch_cancelled", "expired": "batch_expired"}


def result_to_output_line(job: Job | None, result: Result) -> dict[str, Any]:
    """``{"id", "custom_id", "response", "error"}`` as in OpenAI's batch output and error files."""
    custom_id = job.custom_id if job is not None else result.custom_id
    line: dict[str, Any] = {"id": f"batch_req_{result.job_id}", "custom_id": custom_id, "response": None,
                            "error": None}
    if result.status == "completed":
        line["response"] = {"status_code": 200, "request_id": result.job_id, "body": completion_body(job, result)}
        return line
    err = result.error or ErrorInfo(code=result.status, message=f"request {result.status}")
    code = _BATCH_ERROR_CODES.get(result.status, err.code)
    line["error"] = {"code": code, "message": err.message}
    if result.status == "failed":
        status = 400 if err.code == "invalid_request" else 500
        line["response"] = {"status_code": status, "request_id": result.job_id,
                            "body": {"error": {"message": err.message, "type": "invalid_request_error"
                                               if status == 400 else "server_error", "code": err.code}}}
    return line


def line_error_to_output_line(info: LineErrorInfo, custom_id: str | None = None) -> dict[str, Any]:
    """A rejected input line as an error-file line (shaped as ``sluice generate`` writes them)."""
    return {"id": f"line-{info.line}", "custom_id": custom_id, "response": None,
            "error": {"code": info.code, "message": f"line {info.line}: {info.message}", "line": info.line}}


def completion_body(job: Job | None, result: Result) -> dict[str, Any]:
    """A chat.completion or text_completion object for a completed Result."""
    kind = job.kind if job is not None else result.kind
    choices = result.choices or [Choice(index=0, text=result.text, finish_reason=result.finish_reason or "stop")]
    created = int(result.timings.finished or 0)
    u = result.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "total_tokens": u.prompt_tokens + u.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
    model = (job.model if job is not None else None) or result.model or "default"
    if kind == "chat":
        out = [{"index": c.index, "message": _message(c), "logprobs": _chat_logprobs(c.logprobs),
                "finish_reason": _finish(c.finish_reason)} for c in choices]
        return {"id": f"chatcmpl-{result.job_id}", "object": "chat.completion", "created": created,
                "model": model, "choices": out, "usage": usage}
    out = [{"index": c.index, "text": c.text, "logprobs": _completion_logprobs(c.logprobs),
            "finish_reason": _finish(c.finish_reason)} for c in choices]
    return {"id": f"cmpl-{result.job_id}", "object": "text_completion", "created": created, "model": model,
            "choices": out, "usage": usage}


def _message(c: Choice) -> dict[str, Any]:
    if not c.tool_calls:
        return {"role": "assistant", "content": c.text}
    return {"role": "assistant", "content": c.text or None, "tool_calls": c.tool_calls}


def _finish(reason: str | None) -> str:
    # stop | length | tool_calls; an aborted or failed sample keeps its own reason ("abort", "error").
    return reason or "stop"


def _chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(x.token, x.logprob) for x in t.top]}
                        for t in lps]}


def _completion_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None
    offsets, pos = [], 0
    for t in lps:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in lps], "token_logprobs": [t.logprob for t in lps],
            "top_logprobs": [{x.token: x.logprob for x in t.top} for t in lps], "text_offset": offsets}
