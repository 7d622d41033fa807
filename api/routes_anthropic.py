"""Anthropic's Messages API on the queue, in Anthropic's shapes: ``POST /v1/messages`` (streamed or not)
and Message Batches (``POST /v1/messages/batches``, retrieve, list, cancel, delete, results).

Each request becomes the chat job an OpenAI ``/v1/chat/completions`` line makes (jobs/anthropic.py), on the
same queue and workers: an online message is routes_openai.py's one-job interactive batch (its admission,
timeout, cancel-on-disconnect and deltas stream), relayed as Anthropic's events; a Message Batch is a batch
whose endpoint is /v1/messages, submitted, cancelled and read as any other. A request with bad params fails
alone (an errored result naming its custom_id). Errors on these routes take Anthropic's shape
(api/errors.py), and the key may come as ``x-api-key`` (api/gate.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Body, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse
from sluice.api.errors import ApiError, error_for
from sluice.api.routes_openai import (
    _Call,
    _failure,
    _Stream,
    pop_stream,
    queue_chat,
    reply,
)
from sluice.api.state import Redis, State, get_state
from sluice.api.validation import FileScan
from sluice.jobs.anthropic import (
    MESSAGES_URL,
    BatchRequests,
    batch_object,
    chat_body,
    ended,
    message,
    message_id,
    page_message_batches,
    read_requests,
    refused_line,
    result_line,
)
from sluice.jobs.schemas import Batch, Result
from sluice.jobs.store import cancel_batch, delete_batch, get_batch, get_line_errors, iter_results
from sluice.jobs.submit import UnknownModel, resolve_model, submit

router = APIRouter(tags=["anthropic"])


# ---- POST /v1/messages --------------------------------------------------------------------------------
@router.post("/v1/messages", summary="A message, run on the queue (Anthropic's Messages API)")
async def create_message(request: Request, body: Annotated[dict[str, Any], Body()]) -> Any:
    stream = pop_stream(body)
    state = get_state(request)
    try:
        chat = chat_body(body)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    call = await queue_chat(state, chat, MESSAGES_URL, stream)
    return await reply(request, call, _MessageStream(call, include_usage=False) if stream else None, _render)


def _render(call: _Call, result: Result) -> tuple[str, JSONResponse]:
    if result.status == "completed":
        return "200", JSONResponse(message(result, call.job.model))
    status, code, text = _failure(result)
    return str(status), JSONResponse(error_for(MESSAGES_URL, status, f"{code}: {text}"), status_code=status)


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _MessageStream(_Stream):
    """Anthropic's events for one streamed message: message_start, one text block's start, deltas and
    stop, message_delta (stop reason, usage), message_stop; an error as an ``error`` event."""

    def first(self) -> str:
        call = self.call
        start: dict[str, Any] = {"id": message_id(f"{call.batch_id}:0"), "type": "message", "role": "assistant",
                                 "model": call.job.model or call.queue, "content": [], "stop_reason": None,
                                 "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        # (the counts come with message_delta, once the result is in)
        return (_event("message_start", {"type": "message_start", "message": start})
                + _event("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})
                + _event("ping", {"type": "ping"}))

    def text(self, index: int, text: str) -> str:
        self.sent[index] = self.sent.get(index, "") + text
        return _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                              "delta": {"type": "text_delta", "text": text}})

    def finish(self, result: Result) -> list[str]:
        """The rest of the text (what the deltas did not carry), the block's end, the stop reason and usage."""
        final = message(result, self.call.job.model)
        text = final["content"][-1]["text"]
        sent = self.sent.get(0, "")
        rest = text[len(sent):] if text.startswith(sent) else ""
        out = [self.text(0, rest)] if rest else []
        return out + [_event("content_block_stop", {"type": "content_block_stop", "index": 0}),
                      _event("message_delta", {"type": "message_delta", "usage": final["usage"],
                                               "delta": {"stop_reason": final["stop_reason"], "stop_sequence": None}})]

    def error(self, status: int, message: str, code: str) -> str:
        return _event("error", error_for(MESSAGES_URL, status, f"{code}: {message}"))

    def done(self) -> str:
        return _event("message_stop", {"type": "message_stop"})


# ---- Message Batches -----------------------------------------------------------------------------------
@router.post("/v1/messages/batches", summary="Create a Message Batch (Anthropic's shape)")
def create_batch(request: Request, body: Annotated[dict[str, Any], Body()], state: State, r: Redis) -> dict[str, Any]:
    s = state.settings
    try:
        requests = read_requests(body, s.max_batch_lines)
    except ValueError as e:
        raise ApiError(400, str(e)) from None
    scan = _scan(requests, s.max_prompt_chars)
    try:
        queue = resolve_model(r, scan.model)
    except UnknownModel as e:
        raise ApiError(400, str(e)) from None
    batch = submit(requests.lines, r=r, model=queue, endpoint=MESSAGES_URL, line_errors=requests.refused)
    return batch_object(batch, _results_url(request, batch))


def _scan(requests: BatchRequests, max_prompt_chars: int) -> FileScan:
    """Each request checked as an uploaded file's line is (fields, limits, one model); a bad one is refused
    alone, under its custom_id."""
    scan = FileScan()
    refused = {e.line for e in requests.refused}
    for i, line in enumerate(requests.lines):
        if i + 1 in refused:
            continue
        scan.add(i + 1, line.encode(), max_prompt_chars)
        if scan.errors and scan.errors[-1].line == i + 1:
            requests.refuse(i, scan.errors[-1].code, scan.errors[-1].message)
    return scan


def _results_url(request: Request, batch: Batch) -> str:
    return str(request.url_for("message_batch_results", batch_id=batch.id))


def _message_batch(r: Any, batch_id: str) -> Batch:
    batch = get_batch(r, batch_id, max_errors=0)
    if batch is None or batch.endpoint != MESSAGES_URL:
        raise ApiError(404, f"No Message Batch found with id {batch_id!r}.")
    return batch


@router.get("/v1/messages/batches", summary="List Message Batches, newest first (Anthropic's pagination)")
def list_message_batches(request: Request, r: Redis, limit: Annotated[int, Query(ge=1, le=1000)] = 20,
                         after_id: str | None = None, before_id: str | None = None) -> dict[str, Any]:
    if after_id is not None and before_id is not None:
        raise ApiError(400, "give after_id or before_id, not both")
    found = page_message_batches(r, limit=limit, after_id=after_id, before_id=before_id)
    if found is None:
        raise ApiError(404, f"No Message Batch found with id {after_id or before_id!r}.")
    page, more = found
    data = [batch_object(b, _results_url(request, b)) for b in page]
    return {"data": data, "has_more": more, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


@router.get("/v1/messages/batches/{batch_id}", summary="A Message Batch's status and counts")
def retrieve_message_batch(request: Request, batch_id: str, r: Redis) -> dict[str, Any]:
    batch = _message_batch(r, batch_id)
    return batch_object(batch, _results_url(request, batch))


@router.post("/v1/messages/batches/{batch_id}/cancel", summary="Cancel a Message Batch (finished results stay)")
def cancel_message_batch(request: Request, batch_id: str, r: Redis) -> dict[str, Any]:
    _message_batch(r, batch_id)
    batch = cancel_batch(r, batch_id)
    if batch is None:  # deleted meanwhile
        raise ApiError(404, f"No Message Batch found with id {batch_id!r}.")
    return batch_object(batch, _results_url(request, batch))


@router.delete("/v1/messages/batches/{batch_id}", summary="Delete an ended Message Batch and its results")
def delete_message_batch(batch_id: str, r: Redis) -> dict[str, Any]:
    batch = _message_batch(r, batch_id)
    if not ended(batch):
        raise ApiError(400, f"Message Batch {batch_id} is still processing: cancel it first")
    delete_batch(r, batch_id)
    return {"id": batch_id, "type": "message_batch_deleted"}


@router.get("/v1/messages/batches/{batch_id}/results", name="message_batch_results", response_class=StreamingResponse,
            responses={200: {"content": {"application/x-jsonl": {}}}},
            summary="An ended Message Batch's results: one {custom_id, result} line per request (JSONL)")
def message_batch_results(batch_id: str, r: Redis) -> StreamingResponse:
    batch = _message_batch(r, batch_id)
    if not ended(batch):
        raise ApiError(400, f"Message Batch {batch_id} has not ended yet: its results come once it has")
    return StreamingResponse(_result_lines(r, batch_id), media_type="application/x-jsonl")


def _result_lines(r: Any, batch_id: str) -> Iterator[str]:
    """Requests refused at creation first (errored), then every job's outcome in completion order."""
    for info in get_line_errors(r, batch_id):
        yield json.dumps(refused_line(info), ensure_ascii=False) + "\n"
    for result in iter_results(r, batch_id):
        yield json.dumps(result_line(result), ensure_ascii=False) + "\n"
