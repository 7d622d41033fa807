"""Anthropic's Messages API on the job plane (no FastAPI here; api/routes_anthropic.py serves it).

A Messages request (the body of ``POST /v1/messages``, or a Message Batch request's ``params``) becomes the
body of an OpenAI ``/v1/chat/completions`` line, so it runs as the same chat job on the same queue; a
Result is rendered back as Anthropic's Message, a results-file line (``{custom_id, result}``) and the
MessageBatch object. A Message Batch is a batch whose endpoint is ``MESSAGES_URL``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import redis
from sluice.jobs.keys import DEFAULT_QUEUE
from sluice.jobs.schemas import CHAT_URL, Batch, LineErrorInfo, Result, ResultUsage
from sluice.jobs.store import get_batch, list_batches

MESSAGES_URL = "/v1/messages"
MAX_CUSTOM_ID = 64  # characters, as Anthropic allows
# Messages fields that map onto the chat body (Anthropic's name -> the chat body's).
_SAMPLING = {"max_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "stop_sequences": "stop"}
_IGNORED = frozenset({"metadata", "service_tier"})  # accepted; they change nothing here
_UNSUPPORTED = {"tools": "tools", "tool_choice": "tools", "thinking": "extended thinking",
                "container": "containers", "mcp_servers": "MCP servers"}
# Engine finish reasons as Anthropic's stop_reason. A stop sequence ends as "end_turn" too: the engine
# does not say which stop ended a sample (stop_sequence stays null).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# Job error codes that are the request's own doing (the rest are the server's), as the OpenAI routes say.
REQUEST_ERRORS = frozenset({"invalid_request", "result_too_large"})


# ---- a Messages request -> the chat body of an OpenAI line -----------------------------------------
def chat_body(params: Any) -> dict[str, Any]:
    """Anthropic's Messages fields as a /v1/chat/completions body; raises ValueError naming the field."""
    if not isinstance(params, dict):
        raise ValueError("params must be a JSON object")
    for k in params:
        if k in _UNSUPPORTED:
            raise ValueError(f"{k}: {_UNSUPPORTED[k]} are not supported on /v1/messages here "
                             "(use /v1/chat/completions)")
        if k not in _SAMPLING and k not in _IGNORED and k not in ("model", "messages", "system"):
            raise ValueError(f"unknown field {k!r}")
    if not isinstance(params.get("model"), str) or not params["model"]:
        raise ValueError("model: a model name is required")
    if params.get("max_tokens") is None:
        raise ValueError("max_tokens: required")
    body: dict[str, Any] = {"model": params["model"], "messages": _system(params.get("system")) +
                            _messages(params.get("messages"))}
    for theirs, ours in _SAMPLING.items():
        if params.get(theirs) is not None:
            body[ours] = params[theirs]
    return body


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else _text_blocks(system, "system")
    return [{"role": "system", "content": text}]


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: a non-empty list is required")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ValueError(f"messages.{i}.role must be user or assistant")
        content = m.get("content")
        if not isinstance(content, str):
            content = _text_blocks(content, f"messages.{i}.content")
        out.append({"role": m["role"], "content": content})
    if out[-1]["role"] != "user":
        # Anthropic continues a last assistant turn (prefill); the chat template here starts a new one.
        raise ValueError(f"messages.{len(out) - 1}: the last message must be the user's (a prefilled "
                         "assistant turn is not supported here)")
    return out


def _text_blocks(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list):
        raise ValueError(f"{where} must be a string or a list of text blocks")
    texts = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind != "text" or not isinstance(b.get("text"), str):
            raise ValueError(f"{where}.{j}: only text blocks are supported here (got {kind or type(b).__name__})")
        texts.append(b["text"])
    return "".join(texts)


def request_line(custom_id: str, params: Any) -> str:
    """A Message Batch request as an OpenAI batch line (raises ValueError for bad params)."""
    if isinstance(params, dict) and "stream" in params:
        raise ValueError("stream: a batch request is not streamed")
    body = chat_body(params)
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": body},
                      ensure_ascii=False)


@dataclass
class BatchRequests:
    """A Message Batch's requests as OpenAI lines; a request whose params are bad is refused alone."""

    lines: list[str] = field(default_factory=list)  # one per request ("{}" for a refused one)
    custom_ids: list[str] = field(default_factory=list)
    refused: list[LineErrorInfo] = field(default_factory=list)

    def refuse(self, i: int, code: str, message: str) -> None:
        self.refused.append(LineErrorInfo(line=i + 1, code=code, message=message, custom_id=self.custom_ids[i]))
        self.lines[i] = "{}"


def read_requests(body: Any, max_requests: int) -> BatchRequests:
    """``{"requests": [{"custom_id", "params"}, ...]}``: raises ValueError when the batch as a whole is
    bad (no requests, a request without a custom_id or params, a custom_id twice)."""
    if not isinstance(body, dict) or set(body) != {"requests"}:
        extra = sorted(set(body) - {"requests"}) if isinstance(body, dict) else []
        raise ValueError(f"unknown field {extra[0]!r}" if extra else "requests: a list of requests is required")
    requests = body["requests"]
    if not isinstance(requests, list) or not requests:
        raise ValueError("requests: a non-empty list is required")
    if len(requests) > max_requests:
        raise ValueError(f"requests: {len(requests)} requests; at most {max_requests} per batch")
    out, seen = BatchRequests(), set()
    for i, req in enumerate(requests):
        cid = req.get("custom_id") if isinstance(req, dict) else None
        if not isinstance(cid, str) or not 1 <= len(cid) <= MAX_CUSTOM_ID:
            raise ValueError(f"requests.{i}.custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters")
        if cid in seen:
            raise ValueError(f"requests.{i}.custom_id {cid!r} appears twice")
        if set(req) != {"custom_id", "params"}:
            extra = sorted(set(req) - {"custom_id", "params"})
            raise ValueError(f"requests.{i}: " + (f"unknown field {extra[0]!r}" if extra else "params is required"))
        seen.add(cid)
        out.custom_ids.append(cid)
        out.lines.append("{}")
        try:
            out.lines[i] = request_line(cid, req["params"])
        except ValueError as e:
            out.refuse(i, "invalid_request", f"params: {e}")
    return out


# ---- a Result -> Anthropic's Message, result line, errors --------------------------------------------
def message_id(job_id: str) -> str:
    return f"msg_{job_id}"


def stop_reason(finish_reason: str | None) -> str:
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn")


def usage(u: ResultUsage) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from the rest of the input."""
    return {"input_tokens": u.prompt_tokens - u.cached_tokens, "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0}


def message(result: Result, model: str | None = None) -> dict[str, Any]:
    """A completed Result as Anthropic's Message (a reasoning model's thinking as a thinking block)."""
    first = result.choices[0] if result.choices else None
    content: list[dict[str, Any]] = []
    if first is not None and first.reasoning is not None:
        content.append({"type": "thinking", "thinking": first.reasoning, "signature": ""})
    content.append({"type": "text", "text": first.text if first is not None else result.text})
    return {"id": message_id(result.job_id), "type": "message", "role": "assistant",
            "model": model or result.model or DEFAULT_QUEUE, "content": content,
            "stop_reason": stop_reason(result.finish_reason), "stop_sequence": None, "usage": usage(result.usage)}


def error_response(kind: str, message: str) -> dict[str, Any]:
    """Anthropic's error shape (an HTTP error's body, and an errored result's ``error``)."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def failure_kind(code: str) -> str:
    return "invalid_request_error" if code in REQUEST_ERRORS else "api_error"


def result_line(result: Result) -> dict[str, Any]:
    """A Result as a line of a Message Batch's results file."""
    if result.status == "completed":
        outcome: dict[str, Any] = {"type": "succeeded", "message": message(result)}
    elif result.status == "failed":
        code = result.error.code if result.error else "failed"
        text = result.error.message if result.error else "the request failed"
        outcome = {"type": "errored", "error": error_response(failure_kind(code), f"{code}: {text}")}
    else:
        outcome = {"type": "canceled" if result.status == "cancelled" else "expired"}
    return {"custom_id": result.custom_id, "result": outcome}


def refused_line(info: LineErrorInfo) -> dict[str, Any]:
    """A request refused at creation (bad params) as an errored results-file line."""
    return {"custom_id": info.custom_id or f"line-{info.line}",
            "result": {"type": "errored", "error": error_response("invalid_request_error",
                                                                   f"{info.code}: {info.message}")}}


# ---- a Batch -> Anthropic's MessageBatch ------------------------------------------------------------
def ended(batch: Batch) -> bool:
    """Final, and every job's outcome written (an expired or cancelled batch is final before its sweep)."""
    return batch.is_final and batch.counts.done >= batch.counts.total


def batch_object(batch: Batch, results_url: str) -> dict[str, Any]:
    """Anthropic's MessageBatch; ``results_url`` is given once processing has ended."""
    c = batch.counts
    done = ended(batch)
    if done:
        status = "ended"
    elif batch.status in ("cancelling", "cancelled"):
        status = "canceling"
    else:
        status = "in_progress"
    end = next((t for t in (batch.completed_at, batch.failed_at, batch.expired_at, batch.cancelled_at) if t), None)
    return {"id": batch.id, "type": "message_batch", "processing_status": status,
            "request_counts": {"processing": c.total - c.done, "succeeded": c.completed,
                               "errored": c.failed + c.invalid, "canceled": c.cancelled, "expired": c.expired},
            "created_at": rfc3339(batch.created_at), "expires_at": rfc3339(batch.expires_at or batch.created_at),
            "ended_at": rfc3339(end) if done and end else None, "archived_at": None,
            "cancel_initiated_at": rfc3339(batch.cancelling_at) if batch.cancelling_at else None,
            "results_url": results_url if done else None}


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


# ---- listing Message Batches ------------------------------------------------------------------------
SCAN_CHUNK = 100  # batches read per round trip while looking for Message Batches among the others


def page_message_batches(r: redis.Redis, *, limit: int, after_id: str | None = None,
                         before_id: str | None = None) -> tuple[list[Batch], bool] | None:
    """One page of Message Batches, newest first, and whether more lie beyond it: older than ``after_id``,
    or (``before_id``) the ones just newer than it. None if the cursor names no Message Batch."""
    cursor = after_id or before_id
    since = None
    if cursor is not None:
        found = get_batch(r, cursor, max_errors=0)
        if found is None or found.endpoint != MESSAGES_URL:
            return None
        since = found.created_at
    newer = before_id is not None
    page: list[Batch] = []
    for batch in _walk(r, since, newer):
        if batch.endpoint == MESSAGES_URL:
            page.append(batch)
            if len(page) > limit:
                break
    more = len(page) > limit
    page = page[:limit]
    return (page[::-1] if newer else page), more


def _walk(r: redis.Redis, since: float | None, newer: bool) -> Iterator[Batch]:
    """Every batch from ``since`` on (exclusive): older ones newest first, or newer ones oldest first."""
    while True:
        chunk = list_batches(r, limit=SCAN_CHUNK, after=since) if newer else \
            list_batches(r, limit=SCAN_CHUNK, before=since)
        if not chunk:
            return
        yield from chunk
        since = chunk[-1].created_at
