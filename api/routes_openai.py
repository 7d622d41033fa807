"""OpenAI's online endpoints on the queue: ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``POST /v1/embeddings``.

The body is checked exactly as a batch line's body (jobs/lines.py: same fields, limits and error
shapes), becomes one job at the interactive priority (jobs/interactive.py has the design: a one-job
batch, a blocking read for its result, text deltas through a stream per request), and the answer is
OpenAI's response (jobs/openai_output.py) or, with ``stream: true``, its chunks as server-sent events
ending in ``data: [DONE]``. A client that goes away cancels its job; one that waits past
SLUICE_INTERACTIVE_TIMEOUT gets 504 (its job cancelled); past SLUICE_INTERACTIVE_MAX_WAITING requests
waiting on the model, 429 with Retry-After. ``/v1/embeddings`` is the same one-job batch on an embedding
model's queue (never streamed), answered as OpenAI's CreateEmbeddingResponse; a request for the other
kind of model than the queue's live workers serve is refused (400) before anything is queued.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import anyio
import redis
from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, StreamingResponse
from sluice.api.errors import ApiError, error_body
from sluice.api.metrics import OpenAIMetrics
from sluice.api.state import AppState, get_state
from sluice.api.validation import check_job, named_model
from sluice.jobs import interactive
from sluice.jobs.embeddings import EMBEDDINGS_URL
from sluice.jobs.interactive import Delta, Waiter
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.openai_output import completion_body
from sluice.jobs.schemas import CHAT_URL, COMPLETIONS_URL, Job, Result
from sluice.jobs.scoring import SCORE_KINDS, SCORED_BY
from sluice.jobs.store import served_kinds
from sluice.jobs.submit import UnknownModel, resolve_model, submit_job
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

router = APIRouter(tags=["openai"])

BLOCK_S = 1.0  # seconds per blocking read: between reads, the client's presence and the worker's are checked
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
STALE_AFTER_FACTOR = 2  # an admitted request older than this many timeouts is one whose API died


@router.post("/v1/chat/completions", summary="A chat completion, run on the queue (OpenAI's shape)")
async def chat_completions(request: Request, body: Annotated[dict[str, Any], Body()]) -> Any:
    return await _serve(request, body, CHAT_URL)


@router.post("/v1/completions", summary="A text completion, run on the queue (OpenAI's shape)")
async def completions(request: Request, body: Annotated[dict[str, Any], Body()]) -> Any:
    return await _serve(request, body, COMPLETIONS_URL)


@router.post("/v1/embeddings", summary="Embeddings, computed on the queue (OpenAI's shape)")
async def embeddings(request: Request, body: Annotated[dict[str, Any], Body()]) -> Any:
    return await serve_once(request, body, EMBEDDINGS_URL)


async def serve_once(request: Request, body: dict[str, Any], url: str) -> Any:
    """A request that is never streamed (embeddings, scores): one job, its one answer."""
    state = get_state(request)
    job = _parse(body, url, state.settings.max_prompt_chars)  # ``stream`` is not one of its fields
    call = await run_in_threadpool(_queue, state, job, url)
    try:
        return await _answer(request, call)
    finally:
        await call.close()


@dataclass
class _Call:
    """One request on its way: where it is queued, and how long it may wait."""

    state: AppState
    job: Job
    queue: str
    batch_id: str
    url: str
    started: float = field(default_factory=time.monotonic)
    answered: bool = False

    @property
    def deadline(self) -> float:
        return self.started + self.state.settings.interactive_timeout

    def metrics(self, request: Request) -> OpenAIMetrics:
        return request.app.state.openai_metrics

    async def close(self) -> None:
        """Its keys go; an unanswered job is cancelled (a worker running it aborts it). Shielded: this runs
        while the request is being cancelled (the client went away)."""
        r = self.state.redis()
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(interactive.close, r, self.queue, self.batch_id, not self.answered)


async def _serve(request: Request, body: dict[str, Any], url: str) -> Any:
    stream, include_usage = _stream_options(body)
    state = get_state(request)
    job = _parse(body, url, state.settings.max_prompt_chars)
    if stream:
        job = job.model_copy(update={"stream": True})
    call = await run_in_threadpool(_queue, state, job, url)
    return await reply(request, call, _Stream(call, include_usage) if stream else None)


async def reply(request: Request, call: _Call, stream: _Stream | None, render: Render | None = None) -> Any:
    """A queued call's answer: ``stream``'s events when given, else the rendered result once it comes (the
    call closed after; a stream closes it when it ends)."""
    if stream is not None:
        return _EventStream(_sse(request, stream), lambda: _end_stream(request, stream))
    try:
        return await _answer(request, call, render)
    finally:
        await call.close()


def pop_stream(body: dict[str, Any], **error: Any) -> bool:
    """``stream``, taken out of the body (a batch line has none); ``error``: the refusal's code and param."""
    stream = body.pop("stream", False)
    if stream not in (True, False, None):
        raise ApiError(400, "stream must be a boolean", **error)
    return bool(stream)


async def queue_chat(state: AppState, chat: dict[str, Any], url: str, stream: bool, **update: Any) -> _Call:
    """A request of another API (Anthropic's Messages, OpenAI's Responses) mapped to a chat body, queued as
    one chat job whose answer takes ``url``'s shape; ``update``: fields set on the job."""
    job = _parse(chat, CHAT_URL, state.settings.max_prompt_chars)
    job = job.model_copy(update={**update, "stream": True} if stream else update)
    return await run_in_threadpool(_queue, state, job, url)


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options``, taken out of the body (a batch line has neither)."""
    opts = body.pop("stream_options", None)
    stream = pop_stream(body, code="invalid_request", param="stream")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError(400, "stream_options must be an object", code="invalid_request", param="stream_options")
    return bool(stream), bool((opts or {}).get("include_usage"))


def _parse(body: dict[str, Any], url: str, max_prompt_chars: int) -> Job:
    """The body read as the body of a batch line for ``url``."""
    text = json.dumps({"custom_id": "request", "method": "POST", "url": url, "body": body})
    try:
        job = parse_line(text, 1)
        check_job(job, max_prompt_chars)
    except LineError as e:
        raise ApiError(400, e.message, code=e.code) from None
    return job


def _queue(state: AppState, job: Job, url: str) -> _Call:
    """Admit the request and queue its job (in the thread pool: these are blocking round trips)."""
    r, s = state.redis(), state.settings
    try:
        queue = resolve_model(r, named_model(job))
    except UnknownModel as e:
        raise ApiError(400, str(e), code="model_not_found", param="model") from None
    _check_kind(r, queue, job, url)
    call = _Call(state, job, queue, interactive.new_request_id(), url)
    if not interactive.admit(r, queue, call.batch_id, s.interactive_max_waiting,
                             STALE_AFTER_FACTOR * s.interactive_timeout):
        raise ApiError(429, f"{s.interactive_max_waiting} requests are already waiting on model {queue!r}; retry "
                       "shortly", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    try:
        submit_job(r, job, queue, batch_id=call.batch_id, priority=s.interactive_priority,
                   metadata={"interactive": url}, completion_window=STALE_AFTER_FACTOR * s.interactive_timeout)
    except BaseException:
        interactive.close(r, queue, call.batch_id, cancel=False)
        raise
    return call


def _check_kind(r: redis.Redis, queue: str, job: Job, url: str) -> None:
    """Refuse a request for the other kind of model than the queue's live workers serve (its worker would
    fail it anyway: this answers at once, and without a worker's round trip). No live worker: no check."""
    want = {"embedding"} if job.kind == "embedding" else set(SCORED_BY) if job.kind in SCORE_KINDS else {"generation"}
    kinds = served_kinds(r).get(queue)
    if not kinds or want & kinds:
        return
    does = {"generation": "generates text", "embedding": "serves embeddings",
            "score": "is a cross-encoder (it scores pairs of texts)"}.get(sorted(kinds)[0], "serves another kind")
    needs = ("an embedding model" if job.kind == "embedding" else "an embedding or cross-encoder model"
             if job.kind in SCORE_KINDS else "a text generation model")
    raise ApiError(400, f"model {queue!r} {does}: {url} needs {needs}", code="model_not_supported", param="model")


def _waiter(request: Request, call: _Call, deltas: bool) -> Waiter:
    app = request.app
    if getattr(app.state, "aredis", None) is None:
        s = call.state.settings
        app.state.aredis = interactive.async_connect(s.redis_url, s.interactive_max_waiting)
    return Waiter(app.state.aredis, call.batch_id, deltas)


# ---- not streamed -----------------------------------------------------------------------------------
async def _gone(request: Request) -> None:
    """Returns once the client has gone away. Its own task: ``request.is_disconnected()`` never sees a
    disconnect behind a BaseHTTPMiddleware (its receive wrapper always yields, so a non-blocking peek is
    cancelled first), while a blocking receive returns ``http.disconnect`` when it comes."""
    await _disconnected(request.receive)


Render = Callable[[_Call, Result], tuple[str, JSONResponse]]  # a result as (status label, response)


async def _answer(request: Request, call: _Call, render: Render | None = None) -> Any:
    waiter = _waiter(request, call, deltas=False)
    status = "500"
    gone = asyncio.ensure_future(_gone(request))
    try:
        while True:
            left = call.deadline - time.monotonic()
            if left <= 0:
                status = "504"
                raise ApiError(504, f"no answer within {call.state.settings.interactive_timeout:g}s "
                               "(SLUICE_INTERACTIVE_TIMEOUT); the request was cancelled", code="timeout")
            _, result = await waiter.read(min(BLOCK_S, left))
            if result is not None:
                call.answered = True
                status, response = (render or _response)(call, result)
                return response
            if gone.done():
                status = "499"  # the client closed the request: its job is cancelled in close()
                return JSONResponse(error_body(400, "the client went away", code="client_closed"), status_code=499)
    finally:
        gone.cancel()
        call.metrics(request).latency.labels(call.url, "false", status).observe(time.monotonic() - call.started)


def _response(call: _Call, result: Result) -> tuple[str, JSONResponse]:
    if result.status == "completed":
        return "200", JSONResponse(completion_body(call.job, result))
    status, code, message = _failure(result)
    return str(status), JSONResponse(error_body(status, message, code=code), status_code=status)


def _failure(result: Result) -> tuple[int, str, str]:
    err = result.error
    code = err.code if err else result.status
    message = err.message if err else f"the request {result.status}"
    if result.status == "failed" and code in ("invalid_request", "result_too_large"):  # the request's own doing
        return 400, code, message
    return 500, code, message


# ---- streamed ---------------------------------------------------------------------------------------
@dataclass
class _Stream:
    """What a stream has sent: the run (worker, attempt) whose text it is, the text per sample."""

    call: _Call
    include_usage: bool
    status: str = "499"  # until something else is known: the client went away
    run: tuple[str, str] | None = None
    sent: dict[int, str] = field(default_factory=dict)
    first_token_at: float | None = None

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        job = self.call.job
        chat = job.kind == "chat"
        obj: dict[str, Any] = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{self.call.batch_id}:0",
                               "object": "chat.completion.chunk" if chat else "text_completion",
                               "created": int(time.time()), "model": job.model or self.call.queue, "choices": choices}
        if self.include_usage:
            obj["usage"] = usage
        return _event(obj)

    def text(self, index: int, text: str) -> str:
        self.sent[index] = self.sent.get(index, "") + text
        if self.call.job.kind == "chat":
            return self.chunk([{"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])
        return self.chunk([{"index": index, "text": text, "logprobs": None, "finish_reason": None}])

    def first(self) -> str:
        """The opening chunk of a chat stream: the assistant's role."""
        n = self.call.job.params.n
        return self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None} for i in range(n)])

    def deltas(self, ds: list[Delta]) -> list[str]:
        """Chunks of the deltas of one run; raises _RunChanged when another run takes over once text was sent."""
        out = []
        for d in ds:
            if self.run is None:
                self.run = d.run
            elif d.run != self.run:
                raise _RunChanged(f"the worker running this request stopped after sending {len(self.sent)} "
                                  "partial answers (its job is re-run elsewhere; a stream cannot restart)")
            out.append(self.text(d.index, d.text))
        return out

    def finish(self, result: Result) -> list[str]:
        """The rest of each sample's text (what the deltas did not carry), its finish reason, the usage."""
        body = completion_body(self.call.job, result)
        chat = self.call.job.kind == "chat"
        out = []
        for c in body["choices"]:
            i = c["index"]
            final = (c["message"]["content"] or "") if chat else c["text"]
            sent = self.sent.get(i, "")
            rest = final[len(sent):] if final.startswith(sent) else ""
            if chat:
                delta: dict[str, Any] = {"content": rest} if rest else {}
                if c["message"].get("tool_calls"):
                    delta["tool_calls"] = [{**t, "index": k} for k, t in enumerate(c["message"]["tool_calls"])]
                out.append(self.chunk([{"index": i, "delta": delta, "logprobs": c["logprobs"],
                                        "finish_reason": c["finish_reason"]}]))
            else:
                out.append(self.chunk([{"index": i, "text": rest, "logprobs": c["logprobs"],
                                        "finish_reason": c["finish_reason"]}]))
        if self.include_usage:
            out.append(self.chunk([], body["usage"]))
        return out

    def error(self, status: int, message: str, code: str) -> str:
        return _error_event(status, message, code)

    def done(self) -> str:
        return "data: [DONE]\n\n"


class _RunChanged(Exception):
    pass


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _error_event(status: int, message: str, code: str) -> str:
    return _event(error_body(status, message, code=code))


class _EventStream(StreamingResponse):
    """Server-sent events whose end, however it comes (the last event, the client gone, the server
    stopping), runs ``on_end`` at once: not in the generator's ``finally``, which Starlette leaves suspended
    when it cancels the stream between two events, so that it ran only once garbage collected."""

    def __init__(self, events: AsyncGenerator[str, None], on_end: Callable[[], Awaitable[None]]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events, self.on_end = events, on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._send_all, send, tg.cancel_scope)
                await _disconnected(receive)  # the client went away: the stream stops now, not at its next event
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()
                await self.on_end()

    async def _send_all(self, send: Send, scope: anyio.CancelScope) -> None:
        try:
            await self.stream_response(send)
        except OSError:
            pass  # a server that says the client is gone by failing the send (ASGI 2.4): gone all the same
        scope.cancel()  # done: stop listening for the client


async def _disconnected(receive: Receive) -> None:
    """Returns once ``http.disconnect`` comes (the request's body was read before the stream began)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _end_stream(request: Request, s: _Stream) -> None:
    call = s.call
    call.metrics(request).latency.labels(call.url, "true", s.status).observe(time.monotonic() - call.started)
    await call.close()


async def _sse(request: Request, s: _Stream) -> AsyncGenerator[str, None]:
    """The events of one streamed request; ``s.status`` says how it ended (_EventStream cleans up)."""
    call = s.call
    waiter = _waiter(request, call, deltas=True)
    metrics = call.metrics(request)
    if call.job.kind == "chat":
        yield s.first()
    while True:
        left = call.deadline - time.monotonic()
        if left <= 0:
            s.status = "504"
            yield s.error(504, f"no answer within {call.state.settings.interactive_timeout:g}s "
                          "(SLUICE_INTERACTIVE_TIMEOUT); the request was cancelled", "timeout")
            return
        ds, result = await waiter.read(min(BLOCK_S, left))
        try:
            chunks = s.deltas(ds)
        except _RunChanged as e:
            s.status = "500"
            yield s.error(500, str(e), "worker_lost")
            return
        if chunks and s.first_token_at is None:
            s.first_token_at = time.monotonic()
            metrics.ttft.labels(call.url).observe(s.first_token_at - call.started)
        for c in chunks:
            yield c
        if result is not None:
            call.answered = True
            if result.status != "completed":
                code_status, code, message = _failure(result)
                s.status = str(code_status)
                yield s.error(code_status, message, code)
                return
            s.status = "200"
            if s.first_token_at is None:
                metrics.ttft.labels(call.url).observe(time.monotonic() - call.started)
            for c in s.finish(result):
                yield c
            yield s.done()
            return
        if not ds and s.run is not None and not await waiter.worker_alive(s.run[0]):
            s.status = "500"
            yield s.error(500, f"the worker running this request ({s.run[0]}) stopped mid-stream (crashed?); "
                          "the request was cancelled", "worker_lost")
            return
