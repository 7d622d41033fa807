"""OpenAI's Responses API on the queue: ``POST /v1/responses``, streamed or not.

The request becomes the chat job a ``/v1/chat/completions`` line makes (jobs/responses.py), on the same
queue and workers, as routes_openai.py's one-job interactive batch (its admission, timeout,
cancel-on-disconnect and deltas stream); the answer is the Response object, or with ``stream: true`` the
Responses events (response.created, response.in_progress, output items and content parts added, text
deltas, their done events, response.completed), each with its sequence_number. Nothing is stored:
``GET /v1/responses/{id}`` is a 404 saying so, and ``previous_response_id`` a 400.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse
from sluice.api.errors import ApiError, error_body
from sluice.api.routes_openai import (
    _Call,
    _failure,
    _Stream,
    pop_stream,
    queue_chat,
    reply,
)
from sluice.api.state import get_state
from sluice.jobs.responses import (
    NOT_STORED,
    RESPONSES_URL,
    chat_body,
    request_echo,
    response_body,
    response_id,
    skeleton,
)
from sluice.jobs.schemas import Result

router = APIRouter(tags=["openai"])


@router.post("/v1/responses", summary="A response, run on the queue (OpenAI's Responses API)")
async def create_response(request: Request, body: Annotated[dict[str, Any], Body()]) -> Any:
    stream = pop_stream(body, code="invalid_request", param="stream")
    state = get_state(request)
    try:
        chat = chat_body(body)
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_request") from None
    call = await queue_chat(state, chat, RESPONSES_URL, stream, api="responses")
    echo = request_echo(body)
    return await reply(request, call, _ResponseStream(call, include_usage=False, echo=echo) if stream else None,
                       lambda c, r: _render(c, r, echo))


@router.get("/v1/responses/{response_id}", summary="Not kept: responses are not stored here")
def retrieve_response(response_id: str) -> Any:
    raise ApiError(404, f"no response {response_id!r}: {NOT_STORED}", code="not_found")


def _render(call: _Call, result: Result, echo: dict[str, Any]) -> tuple[str, JSONResponse]:
    if result.status == "completed":
        return "200", JSONResponse(response_body(result, call.job.model, echo))
    status, code, message = _failure(result)
    return str(status), JSONResponse(error_body(status, message, code=code), status_code=status)


class _ResponseStream(_Stream):
    """The Responses events of one streamed request. The message item opens with the first text delta
    (a reply whose text comes only with the result, a tool call's, opens every item then)."""

    def __init__(self, call: _Call, include_usage: bool, echo: dict[str, Any]) -> None:
        super().__init__(call, include_usage)
        self.echo = echo
        self.seq = 0
        self.rid = response_id(f"{call.batch_id}:0")
        self.opened = False  # the message item announced (at output index 0)
        self.final: dict[str, Any] | None = None

    def event(self, kind: str, **data: Any) -> str:
        obj = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def _skeleton(self, status: str) -> dict[str, Any]:
        call = self.call
        return skeleton(self.rid, time.time(), call.job.model or call.queue, self.echo, status)

    def first(self) -> str:
        return (self.event("response.created", response=self._skeleton("in_progress"))
                + self.event("response.in_progress", response=self._skeleton("in_progress")))

    def _item_id(self) -> str:
        return f"msg_{self.rid.removeprefix('resp_')}"

    def _open_message(self, index: int = 0) -> str:
        self.opened = True
        item = {"id": self._item_id(), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return (self.event("response.output_item.added", output_index=index, item=item)
                + self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

    def text(self, index: int, text: str) -> str:
        if index != 0:
            return ""  # one answer per response (n is 1)
        self.sent[0] = self.sent.get(0, "") + text
        head = "" if self.opened else self._open_message()
        return head + self.event("response.output_text.delta", item_id=self._item_id(), output_index=0,
                                 content_index=0, delta=text, logprobs=[])

    def finish(self, result: Result) -> list[str]:
        """The rest of the message's text, every item's done events (the other items whole), the response."""
        final = response_body(result, self.call.job.model, self.echo)
        items = final["output"]
        if self.opened:  # the message was announced first: it stays first
            items.sort(key=lambda it: it["type"] != "message")
        self.final = final
        out = []
        for i, item in enumerate(items):
            if item["type"] == "message":
                out += self._message_done(i, item)
            else:
                out.append(self.event("response.output_item.added", output_index=i, item=_pending(item)))
                if item["type"] == "function_call":
                    out += [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=i,
                                       delta=item["arguments"]),
                            self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                       name=item["name"], arguments=item["arguments"])]
                out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out

    def _message_done(self, i: int, item: dict[str, Any]) -> list[str]:
        text = item["content"][0]["text"]
        sent = self.sent.get(0, "")
        rest = text[len(sent):] if text.startswith(sent) else ""
        out = [] if self.opened else [self._open_message(i)]
        if rest:
            out.append(self.event("response.output_text.delta", item_id=item["id"], output_index=i, content_index=0,
                                  delta=rest, logprobs=[]))
        return out + [
            self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0, text=text,
                       logprobs=[]),
            self.event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                       part=item["content"][0]),
            self.event("response.output_item.done", output_index=i, item=item)]

    def error(self, status: int, message: str, code: str) -> str:
        return self.event("error", code=code, message=message, param=None)

    def done(self) -> str:
        final = self.final or self._skeleton("completed")
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return self.event(kind, response=final)


def _pending(item: dict[str, Any]) -> dict[str, Any]:
    """An item as announced before its done event."""
    return {**item, "status": "in_progress"} if item["type"] == "function_call" else item
