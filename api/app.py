"""The FastAPI app: OpenAI's Files and Batches APIs, native jobs and results, health and metrics.

``create_app()`` builds a fresh app (tests build their own); ``sluice serve`` runs
``uvicorn --factory api.app:create_app``. Everything under ``/v1`` needs ``Authorization: Bearer
$SLUICE_API_KEY`` when that variable is set; ``/healthz``, ``/metrics`` and the OpenAPI schema do not.
Limits (``api.settings``): upload size, requests per batch file, prompt characters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import dashboard, errors, routes_batches, routes_files, routes_jobs
from api.metrics import make_registry
from api.settings import Settings
from api.state import AppState, State, require_key
from jobs.settings import load
from jobs.store import list_workers

UPLOAD_SLACK = 64 * 1024  # multipart framing around the file's bytes
FILE_SWEEP_EVERY = 60.0  # seconds between deletions of expired files


def create_app(settings: Settings | None = None) -> FastAPI:
    state = AppState(settings or load(Settings))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(_sweep_files(state))
        yield
        sweeper.cancel()
        state.close()

    app = FastAPI(title="Sluice", version="0.1.0", lifespan=lifespan,
                  description="Bulk LLM generation with OpenAI's Batch API (Files + Batches), native single jobs "
                              "and progressive results.")
    app.state.sluice = state
    errors.install(app)
    auth = [Depends(require_key)]
    for r in (routes_files.router, routes_batches.router, routes_jobs.router):
        app.include_router(r, dependencies=auth)
    app.include_router(dashboard.router)  # pages at / and /batches/{id}; its data routes check the key
    app.add_api_route("/v1/models", list_models, methods=["GET"], dependencies=auth, tags=["models"],
                      summary="The models live workers serve")
    app.add_api_route("/healthz", healthz, methods=["GET"], tags=["ops"], summary="Health of the API and job server")
    registry, requests = make_registry(state.redis)
    app.add_api_route("/metrics", _metrics_route(registry), methods=["GET"], tags=["ops"],
                      response_class=Response, summary="Prometheus metrics")
    app.middleware("http")(_middleware(state, requests))
    app.add_middleware(UploadLimit, max_bytes=state.settings.max_upload_bytes + UPLOAD_SLACK)
    app.openapi = _openapi_with_400(app)  # type: ignore[method-assign]
    return app


async def _sweep_files(state: AppState) -> None:
    """Housekeeping for the files on disk: expired uploads and batch output files are deleted."""
    while True:
        try:
            await run_in_threadpool(state.files.delete_expired)
        except OSError:
            pass  # a full or vanished disk: the next sweep tries again
        await asyncio.sleep(FILE_SWEEP_EVERY)


def list_models(state: State) -> dict[str, Any]:
    queues = sorted({w.get("queue") or "default" for w in list_workers(state.redis())})
    return {"object": "list", "data": [{"id": q, "object": "model", "created": 0, "owned_by": "sluice"}
                                       for q in queues]}


def healthz(state: State) -> JSONResponse:
    try:
        workers = list_workers(state.redis())
    except (redis.RedisError, OSError, RuntimeError) as e:
        return JSONResponse({"status": "unavailable", "job_server": f"{type(e).__name__}: {e}"}, status_code=503)
    models = sorted({w.get("queue") or "default" for w in workers})
    return JSONResponse({"status": "ok", "job_server": "ok", "workers": len(workers), "models": models})


def _metrics_route(registry: Any) -> Callable[[], Awaitable[Response]]:
    async def metrics() -> Response:
        body = await run_in_threadpool(generate_latest, registry)  # the collector reads Redis
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return metrics


def _middleware(state: AppState, requests: Any) -> Callable[..., Awaitable[Response]]:
    async def middleware(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if _upload_too_large(request, state.settings.max_upload_bytes):
            # Refused before the body is read: a multipart form is spooled whole before any route runs.
            return JSONResponse(errors.error_body(413, f"the file is larger than {state.settings.max_upload_bytes} "
                                                  "bytes", code="file_too_large", param="file"), status_code=413)
        response = await call_next(request)
        route = request.scope.get("route")
        requests.labels(request.method, getattr(route, "path", "other"), str(response.status_code)).inc()
        return response

    return middleware


class UploadLimit:
    """Counts an upload's bytes as they arrive: chunked transfer has no Content-Length to check first,
    and a multipart form is spooled to disk whole before any route runs. Past the limit the request
    is answered 413 at once and nothing more is read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/files":
            await self.app(scope, receive, send)
            return
        seen = 0
        over = False

        async def counted() -> Message:
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > self.max_bytes:
                over = True  # the form parser sees a disconnect; the 413 below is the answer
                return {"type": "http.disconnect"}
            return msg

        async def guarded(msg: Message) -> None:
            if not over:
                await send(msg)

        try:
            await self.app(scope, counted, guarded)
        except Exception:
            if not over:
                raise
        if over:
            limit = self.max_bytes - UPLOAD_SLACK
            await JSONResponse(errors.error_body(413, f"the file is larger than {limit} bytes", code="file_too_large",
                                                 param="file"), status_code=413)(scope, receive, send)


def _upload_too_large(request: Request, max_bytes: int) -> bool:
    if request.method != "POST" or request.url.path != "/v1/files":
        return False
    try:
        return int(request.headers.get("content-length") or 0) > max_bytes + UPLOAD_SLACK
    except ValueError:
        return False


def _openapi_with_400(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The schema says what the API answers: 400 in OpenAI's error shape where FastAPI would say 422."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()
            error = {"description": "Invalid request (OpenAI's error shape; the message names the field or line)",
                     "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    responses = op.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = error
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


_ERROR_SCHEMA = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}, "required": ["message", "type"]}}, "required": ["error"]}
