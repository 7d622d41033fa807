"""The two input line formats the CLI, the API and ``submit`` read into a Job: OpenAI batch lines
(``{"custom_id", "method", "url", "body"}``) and simple ``{"prompt"|"messages", ...}`` lines. A bad
line raises LineError naming its line."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pydantic import (
    ValidationError,
)
from sluice.jobs import responses
from sluice.jobs.embeddings import EMBEDDINGS_URL, check_input, parse_embedding_body
from sluice.jobs.responses import RESPONSES_URL
from sluice.jobs.schemas import (
    CHAT_URL,
    COMPLETIONS_URL,
    GUIDED_FIELDS,
    MAX_DEADLINE,
    ROLES,
    SAMPLING_FIELDS,
    Job,
    LineErrorInfo,
    SamplingParams,
)
from sluice.jobs.scoring import SCORING_URLS, scoring_fields

_DEFAULT_PARAMS = SamplingParams()


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
_SIMPLE_EMBEDDING = frozenset({"custom_id", "input", "model", "priority", "deadline", "encoding_format",
                               "dimensions"})
# Reasoning models and chat-template options (vLLM's names); reasoning_effort goes to the template too.
_REASONING = frozenset({"chat_template_kwargs", "reasoning_effort", "max_reasoning_tokens"})
_SIMPLE_META = frozenset({"custom_id", "prompt", "prompt_token_ids", "messages", "model", "priority", "deadline",
                          "response_format", "tools", "tool_choice", "echo", "reasoning_effort"})


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
    merged = {**base, **sampling}
    if base.get("chat_template_kwargs") and isinstance(sampling.get("chat_template_kwargs"), str | dict):
        # A line's template options add to the batch's, key by key (as vLLM merges its defaults).
        line = SamplingParams(chat_template_kwargs=sampling["chat_template_kwargs"]).chat_template_kwargs
        merged["chat_template_kwargs"] = {**json.loads(base["chat_template_kwargs"]), **json.loads(line or "{}")}
    return SamplingParams.model_validate(merged)


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
    elif url == EMBEDDINGS_URL:
        fields, sampling = _embedding_body(body), {}
    elif url in SCORING_URLS:
        fields, sampling = scoring_fields(url, body), {}
    elif url == RESPONSES_URL:  # the same chat job, answered in the Responses shape
        fields, sampling = _chat_body(responses.chat_body(body))
        fields["api"] = "responses"
    else:
        raise ValueError(f"url must be {CHAT_URL}, {COMPLETIONS_URL}, {RESPONSES_URL}, {EMBEDDINGS_URL}, /v1/score or "
                         f"/v1/rerank, "
                         f"not {url!r}")
    fields["custom_id"] = custom_id
    if isinstance(body.get("model"), str):
        fields["model"] = body["model"]
    return fields, sampling


def _embedding_body(body: dict[str, Any]) -> dict[str, Any]:
    b = parse_embedding_body(body)
    return {"kind": "embedding", "input": b.input, "encoding_format": b.encoding_format, "dimensions": b.dimensions}


def _check_body_keys(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for k, v in body.items():
        if k in allowed or k in _IGNORED_BODY:
            continue
        if k in _NOOP_BODY and v in _NOOP_BODY[k]:
            continue
        raise ValueError(f"body.{k} is not supported" if k in _NOOP_BODY else f"unknown body field {k!r}")


def _chat_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    _check_body_keys(body, _OPENAI_SAMPLING | _STRUCTURED | _TOOLS | _REASONING | {
        "messages", "max_completion_tokens", "logprobs", "top_logprobs"})
    sampling = {k: v for k, v in body.items() if k in _OPENAI_SAMPLING and v is not None}
    if body.get("max_completion_tokens") is not None:
        sampling["max_tokens"] = body["max_completion_tokens"]
    if body.get("logprobs"):
        sampling["logprobs"] = body.get("top_logprobs") or 0
    fields = {"kind": "chat", "messages": normalize_messages(body.get("messages"))}
    _add_structured(body, fields, sampling, "body.")
    _add_reasoning(body, fields, sampling, "body.")
    return fields, sampling


def _completions_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    _check_body_keys(body, _OPENAI_SAMPLING | _STRUCTURED | {"prompt", "logprobs", "best_of", "echo",
                                                             "prompt_logprobs"})
    if body.get("best_of") not in (None, body.get("n", 1)):
        raise ValueError("body.best_of other than n is not supported")
    sampling = {k: v for k, v in body.items() if k in _OPENAI_SAMPLING and v is not None}
    if body.get("logprobs") is not None:
        sampling["logprobs"] = body["logprobs"]
    if body.get("prompt_logprobs") is not None:
        sampling["prompt_logprobs"] = body["prompt_logprobs"]
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
    if obj.get("prompt_logprobs") is not None and fields["kind"] != "completion":
        raise ValueError(f"{where}prompt_logprobs is for completions (a prompt), not chat")
    if obj.get("echo"):
        if fields["kind"] != "completion":
            raise ValueError(f"{where}echo is for completions (a prompt), not chat")
        if obj.get("logprobs") is not None:  # the prompt's tokens are scored too (engine/prompt_logprobs.py)
            sampling.setdefault("prompt_logprobs", obj["logprobs"])
        fields["echo"] = True


def _add_reasoning(obj: dict[str, Any], fields: dict[str, Any], sampling: dict[str, Any], where: str) -> None:
    """chat_template_kwargs, reasoning_effort (passed to the template as a key of it) and
    max_reasoning_tokens of a body or simple line: all for chat messages."""
    given = [k for k in sorted(_REASONING) if obj.get(k) is not None]
    if given and fields["kind"] != "chat":
        raise ValueError(f"{where}{given[0]} is for chat messages, not a prompt")
    for k in ("chat_template_kwargs", "max_reasoning_tokens"):
        if obj.get(k) is not None:
            sampling[k] = obj[k]
    effort = obj.get("reasoning_effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise ValueError(f"{where}reasoning_effort must be a string (low, medium, high, ...)")
        kwargs = sampling.get("chat_template_kwargs", {})
        if isinstance(kwargs, str):
            kwargs = SamplingParams(chat_template_kwargs=kwargs).chat_template_kwargs or "{}"
            kwargs = json.loads(kwargs)
        if not isinstance(kwargs, dict):
            raise ValueError(f"{where}chat_template_kwargs must be a JSON object")
        sampling["chat_template_kwargs"] = {"reasoning_effort": effort, **kwargs}


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
    """A string, token ids, or (OpenAI's list prompt) several of either: one job whose result holds every
    prompt's choices, in order (a list of one is that one prompt)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        parts = [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return {"prompts": parts} if len(parts) > 1 else _prompt_field(parts[0])
    return _prompt_field(_one_prompt(prompt, "prompt"))


def _one_prompt(prompt: Any, where: str) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise ValueError(f"{where} must be a string or a list of token ids (or prompt a list of those)")


def _prompt_field(prompt: str | list[int]) -> dict[str, Any]:
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}


def _simple_fields(obj: dict[str, Any], line_no: int) -> tuple[dict[str, Any], dict[str, Any]]:
    if "input" in obj:
        return _simple_embedding(obj, line_no), {}
    unknown = set(obj) - _SIMPLE_META - SAMPLING_FIELDS - _STRUCTURED
    if unknown:
        raise ValueError(f"unknown field {sorted(unknown)[0]!r}")
    fields: dict[str, Any] = {"custom_id": _simple_custom_id(obj, line_no)}
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
    _add_reasoning(obj, fields, sampling, "")
    return fields, sampling


def _simple_custom_id(obj: dict[str, Any], line_no: int) -> str:
    custom_id = obj.get("custom_id", f"line-{line_no}")
    if isinstance(custom_id, int) and not isinstance(custom_id, bool):
        custom_id = str(custom_id)
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("custom_id must be a non-empty string")
    return custom_id


def _simple_embedding(obj: dict[str, Any], line_no: int) -> dict[str, Any]:
    """``{"custom_id", "input", ...}``: an embedding job (the simple form of a /v1/embeddings line)."""
    unknown = set(obj) - _SIMPLE_EMBEDDING
    if unknown:
        raise ValueError(f"unknown field {sorted(unknown)[0]!r} for an embedding line (input)")
    fields: dict[str, Any] = {"custom_id": _simple_custom_id(obj, line_no), "kind": "embedding",
                              "input": check_input(obj["input"])}
    body = parse_embedding_body({k: obj[k] for k in ("input", "encoding_format", "dimensions") if k in obj})
    fields.update(encoding_format=body.encoding_format, dimensions=body.dimensions)
    for k in ("model", "priority"):
        if obj.get(k) is not None:
            fields[k] = obj[k]
    if obj.get("deadline") is not None:
        fields["deadline"] = parse_deadline(obj["deadline"])
    return fields


def first_model(texts: Iterable[str]) -> str | None:
    """The model the first valid line names (a batch runs on one model)."""
    for line_no, text in enumerate(texts, 1):
        if text.strip():
            try:
                return parse_line(text, line_no).model
            except LineError:
                continue
    return None


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
    """Check chat messages; text parts are joined into one string (a chat template wants strings), unless
    the content has images."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] needs a role in {sorted(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            content = _content_parts(content, i)
        if content is None and m["role"] == "assistant" and m.get("tool_calls"):
            content = ""  # an assistant turn that only calls tools
        if not isinstance(content, str | list):
            raise ValueError(f"messages[{i}].content must be a string or content parts")
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


def _content_parts(parts: list[Any], i: int) -> str | list[dict[str, str]]:
    """Text parts joined into one string; with images, the parts as processors' chat templates read them
    (``{"type": "image", "url": ...}``; the worker reads the URL, within its own limits: engine/image_source.py)."""
    out = [_part(p, i) for p in parts]
    if all(p["type"] == "text" for p in out):
        return "".join(p["text"] for p in out)
    return out


def _part(p: Any, i: int) -> dict[str, str]:
    kind = p.get("type") if isinstance(p, dict) else None
    if kind == "text" and isinstance(p.get("text"), str):
        return {"type": "text", "text": p["text"]}
    if kind == "image_url":
        url = p.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise ValueError(f"messages[{i}].content: an image_url part needs image_url.url")
        return {"type": "image", "url": url}
    if kind == "image" and isinstance(p.get("url"), str) and p["url"]:  # already normalized (a dataset row's line)
        return {"type": "image", "url": p["url"]}
    raise ValueError(f"messages[{i}].content: only text and image_url parts are supported")
