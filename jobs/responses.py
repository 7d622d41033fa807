"""OpenAI's Responses API on the job plane (no FastAPI here; api/routes_responses.py serves it online).

A Responses request (the body of ``POST /v1/responses``, or of a ``/v1/responses`` batch line) becomes the
body of a ``/v1/chat/completions`` line, so it runs as the same chat job: ``input`` (a string, or message
items with input_text parts, function calls and their outputs), ``instructions`` (a system message first),
``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (json_schema / json_object: the guided
JSON path), function ``tools`` and ``tool_choice`` (the tool-call path) and ``reasoning.effort`` (the chat
template's reasoning_effort). A completed Result renders as the Response object: a reasoning item (a
reasoning model's thinking), a message with its output_text, function_call items.

Nothing is kept: ``store`` is accepted (OpenAI's default is true) but a response cannot be retrieved
later, so ``previous_response_id`` and ``conversation`` are refused.
"""

from __future__ import annotations

from typing import Any

from sluice.jobs.keys import DEFAULT_QUEUE
from sluice.jobs.schemas import Choice, Job, Result

RESPONSES_URL = "/v1/responses"
NOT_STORED = ("responses are not stored here (store is accepted but nothing is kept): send the whole "
              "conversation as input instead")
# Accepted; they change nothing here (store: see NOT_STORED).
_IGNORED = frozenset({"model", "store", "metadata", "user", "service_tier", "parallel_tool_calls", "truncation",
                      "include", "prompt_cache_key", "safety_identifier", "max_tool_calls", "background"})
_SAMPLING = {"max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p"}
# Sluice's (and vLLM's) extensions to the chat body, passed as they are (a client sends them in extra_body).
_EXTENSIONS = frozenset({"stream", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                         "seed", "stop", "presence_penalty", "frequency_penalty", "chat_template_kwargs",
                         "max_reasoning_tokens"})
_REFUSED = {"previous_response_id": NOT_STORED, "conversation": NOT_STORED,
            "prompt": "stored prompt templates are not supported here",
            "stream_options": "stream_options is not supported on /v1/responses"}
_ROLES = frozenset({"system", "developer", "user", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


# ---- a Responses request -> the chat body of an OpenAI line -----------------------------------------
def chat_body(body: Any) -> dict[str, Any]:
    """The Responses request as a /v1/chat/completions body; raises ValueError naming the field."""
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    for k, v in body.items():
        if k in _REFUSED and v is not None:
            raise ValueError(f"{k}: {_REFUSED[k]}")
        if k == "background" and v:
            raise ValueError("background: background responses are not supported here (use a batch)")
        if k not in _IGNORED and k not in _SAMPLING and k not in _EXTENSIONS and k not in _REFUSED and k not in (
                "input", "instructions", "text", "tools", "tool_choice", "reasoning"):
            raise ValueError(f"unknown field {k!r}")
    chat: dict[str, Any] = {"messages": _instructions(body.get("instructions")) + _input(body.get("input"))}
    if isinstance(body.get("model"), str):
        chat["model"] = body["model"]
    for theirs, ours in _SAMPLING.items():
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    chat.update({k: body[k] for k in _EXTENSIONS if body.get(k) is not None})
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("tools"):
        chat["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])] if isinstance(body["tools"], list) \
            else _fail("tools must be a list")
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


def _fail(message: str) -> Any:
    raise ValueError(message)


def _instructions(text: Any) -> list[dict[str, Any]]:
    if text is None:
        return []
    if not isinstance(text, str):
        raise ValueError("instructions must be a string")
    return [{"role": "system", "content": text}]


def _input(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValueError("input must be a string or a non-empty list of input items")
    out = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            out.append(_message(item, i))
        elif kind == "function_call":
            out.append(_function_call(item, i))
        elif kind == "function_call_output":
            out.append(_function_output(item, i))
        elif kind == "reasoning":
            continue  # an earlier turn's thinking: chat templates leave it out of the prompt too
        else:
            raise ValueError(f"input[{i}]: input items of type {kind!r} are not supported here (message, "
                             "function_call, function_call_output, reasoning)")
    if not out:
        raise ValueError("input has no message")
    return out


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise ValueError(f"input[{i}].role must be one of {', '.join(sorted(_ROLES))}")
    content = item.get("content")
    if not isinstance(content, str):
        content = _text_parts(content, i)
    return {"role": "system" if role == "developer" else role, "content": content}


def _text_parts(parts: Any, i: int) -> str:
    if not isinstance(parts, list):
        raise ValueError(f"input[{i}].content must be a string or a list of input_text parts")
    texts = []
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(p.get("text"), str):
            raise ValueError(f"input[{i}].content[{j}]: only input_text parts are supported here (got {kind!r})")
        texts.append(p["text"])
    return "".join(texts)


def _function_call(item: dict[str, Any], i: int) -> dict[str, Any]:
    if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
        raise ValueError(f"input[{i}]: a function_call item needs name and call_id")
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": item["call_id"], "type": "function",
         "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}]}


def _function_output(item: dict[str, Any], i: int) -> dict[str, Any]:
    output = item.get("output")
    if not isinstance(output, str):
        output = _text_parts(output, i)
    if not isinstance(item.get("call_id"), str):
        raise ValueError(f"input[{i}]: a function_call_output item needs call_id")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _text_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ValueError("text must be an object ({'format': ...})")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ValueError("text.format.schema must be a JSON schema object")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"]}}
    raise ValueError("text.format.type must be text, json_object or json_schema")


def _tool(tool: Any, i: int) -> dict[str, Any]:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind != "function":
        raise ValueError(f"tools[{i}]: only function tools are supported here (got {kind!r})")
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ValueError(f"tools[{i}].name is required")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError("tool_choice must be auto, none, required or {'type': 'function', 'name': ...}")


def _reasoning_effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise ValueError("reasoning must be an object ({'effort': ...})")
    effort = reasoning.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise ValueError("reasoning.effort must be a string (low, medium, high, ...)")
    return effort


# ---- a Result -> the Response object ----------------------------------------------------------------
def response_id(job_id: str) -> str:
    return f"resp_{job_id}"


def request_echo(body: dict[str, Any] | None) -> dict[str, Any]:
    """The request's settings a Response repeats (OpenAI echoes them); none known for a batch line's."""
    body = body or {}
    tools = [t for t in body.get("tools") or [] if isinstance(t, dict)]
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tools": [{"strict": True, "parameters": {}, **t} for t in tools],
            "tool_choice": body.get("tool_choice") or "auto",
            "text": body.get("text") or {"format": {"type": "text"}},
            "reasoning": body.get("reasoning"), "parallel_tool_calls": True}


def skeleton(rid: str, created: float, model: str, echo: dict[str, Any], status: str) -> dict[str, Any]:
    """A Response without output (the one a stream opens with)."""
    return {"id": rid, "object": "response", "created_at": int(created), "model": model, "status": status,
            "output": [], "error": None, "incomplete_details": None, "usage": None, "metadata": {}, "store": False,
            **echo}


def output_items(rid: str, choice: Choice, status: str) -> list[dict[str, Any]]:
    """The reasoning item (a reasoning model's thinking), the message, the function calls."""
    items: list[dict[str, Any]] = []
    if choice.reasoning is not None:
        items.append({"id": f"rs_{rid}", "type": "reasoning", "summary": [], "status": "completed",
                      "content": [{"type": "reasoning_text", "text": choice.reasoning}]})
    if choice.text or not choice.tool_calls:
        items.append({"id": f"msg_{rid}", "type": "message", "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": choice.text, "annotations": [], "logprobs": []}]})
    for k, call in enumerate(choice.tool_calls or []):
        fn = call.get("function", {})
        items.append({"id": f"fc_{rid}_{k}", "type": "function_call", "call_id": call.get("id", f"call_{k}"),
                      "name": fn.get("name", ""), "arguments": fn.get("arguments", "{}"), "status": "completed"})
    return items


def response_body(result: Result, model: str | None = None, echo: dict[str, Any] | None = None) -> dict[str, Any]:
    """A completed Result as the Response object (``echo``: the request's settings, request_echo)."""
    rid = response_id(result.job_id)
    choice = result.choices[0] if result.choices else Choice(index=0, text=result.text,
                                                             finish_reason=result.finish_reason or "stop")
    incomplete = choice.finish_reason == "length"
    status = "incomplete" if incomplete else "completed"
    out = skeleton(rid, result.timings.finished or 0, model or result.model or DEFAULT_QUEUE,
                   echo if echo is not None else request_echo(None), status)
    u = result.usage
    out.update(output=output_items(rid.removeprefix("resp_"), choice, status),
               incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
               completed_at=None if incomplete else int(result.timings.finished or 0),
               usage={"input_tokens": u.prompt_tokens,
                      "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": u.completion_tokens,
                      "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                      "total_tokens": u.prompt_tokens + u.completion_tokens})
    return out


def is_response(job: Job | None, result: Result) -> bool:
    """Whether the answer takes the Responses shape (the job came from a /v1/responses request)."""
    return (job.api if job is not None else result.api) == "responses"


