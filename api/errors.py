"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` (the SDK reads it); on
Anthropic's routes (``/v1/messages...``), in Anthropic's: ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

from typing import Any

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sluice.jobs.anthropic import MESSAGES_URL, error_response
from sluice.jobs.full import JobServerFull
from sluice.jobs.spill import SpilledResultsMissing
from starlette.exceptions import HTTPException

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "server_error", 504: "server_error", 507: "server_error"}

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.extra = status, message, code, param, extra
        self.headers = headers


def not_found(what: str, id_: str) -> ApiError:
    return ApiError(404, f"No {what} found with id {id_!r}.", code="not_found")


def error_body(status: int, message: str, code: str | None = None, param: str | None = None,
               **extra: Any) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code, **extra}}


def is_anthropic(path: str) -> bool:
    """Whether ``path`` is one of Anthropic's routes (their errors take Anthropic's shape)."""
    return path == MESSAGES_URL or path.startswith(MESSAGES_URL + "/")


def error_for(path: str, status: int, message: str, code: str | None = None, param: str | None = None,
              **extra: Any) -> dict[str, Any]:
    """The error body in the shape of the API ``path`` belongs to."""
    if is_anthropic(path):
        kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return error_response(kind, message)
    return error_body(status, message, code, param, **extra)


def _respond(request: Request, status: int, message: str, code: str | None = None, param: str | None = None,
             headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(error_for(request.url.path, status, message, code, param, **extra), status_code=status,
                        headers=headers)


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return _respond(request, e.status, e.message, e.code, e.param, headers=e.headers, **e.extra)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return _respond(request, e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        # 400 as OpenAI answers, not FastAPI's 422; the message names the first bad field.
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(x) for x in err.get("loc", ()))
        return _respond(request, 400, f"{where}: {err.get('msg')}" if where else str(err.get("msg")), code="invalid_request",
                        param=where or None)

    # The job server's memory is full (maxmemory): nothing of the request was kept; retry later.
    @app.exception_handler(JobServerFull)
    async def _full(request: Request, e: JobServerFull) -> JSONResponse:
        return _respond(request, 507, str(e), code="job_server_full", headers={"Retry-After": "60"})

    # A replica (the old primary after a failover, or a URL pointing at one) refuses every write: nothing of
    # the request was kept, and it is the deployment to fix, not the request. Reads still work.
    @app.exception_handler(redis.ReadOnlyError)
    async def _read_only(request: Request, e: redis.ReadOnlyError) -> JSONResponse:
        return _respond(request, 503, "the job server is a read-only replica (after a failover?): nothing was queued; point "
                        f"SLUICE_REDIS_URL at the primary: {e}", code="job_server_read_only", headers={"Retry-After": "30"})

    # Only an unreachable server is a 503; any other Redis error is a bug and stays a 500.
    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _redis_down(request: Request, e: redis.RedisError) -> JSONResponse:
        return _respond(request, 503, f"the job server is unavailable: {type(e).__name__}: {e}", code="job_server_unavailable")

    # Results spilled to a directory this API does not see: a deployment error, said as such.
    @app.exception_handler(SpilledResultsMissing)
    async def _spill_missing(request: Request, e: SpilledResultsMissing) -> JSONResponse:
        return _respond(request, 500, str(e), code="results_not_readable")
