"""The door every request passes before any route runs: the API key, then the body's size.

Both are checked here, in plain ASGI, because FastAPI reads (and parses) a body before it resolves a
route's dependencies, and spools a multipart form to disk whole: a 401 or 413 decided there comes after
the bytes were read. Here the key is checked from the headers alone and a body is counted as it
arrives, so an unauthenticated or oversized request costs the API no more than a limit's worth.
"""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse
from sluice.api.errors import error_for
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UPLOAD_PATH = "/v1/files"
MESSAGE_BATCHES_PATH = "/v1/messages/batches"  # a whole batch in one JSON body: capped as an upload is
UPLOAD_SLACK = 64 * 1024  # multipart framing around the file's bytes


def key_ok(authorization: str | None, key: str | None, x_api_key: str | None = None) -> bool:
    """Whether the request carries the key: ``Authorization: Bearer <key>`` (OpenAI's clients) or
    ``x-api-key: <key>`` (Anthropic's); always, when no key is set. The one check of SLUICE_API_KEY."""
    if key is None:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    bearer = scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), key.encode())
    return bearer or (x_api_key is not None and secrets.compare_digest(x_api_key.strip().encode(), key.encode()))


UNAUTHORIZED = "Incorrect or missing API key: send 'Authorization: Bearer <SLUICE_API_KEY>' or 'x-api-key: <SLUICE_API_KEY>'."


def unauthorized(path: str) -> JSONResponse:
    return JSONResponse(error_for(path, 401, UNAUTHORIZED, code="invalid_api_key"), status_code=401,
                        headers={"WWW-Authenticate": "Bearer"})


class Gate:
    """``/v1`` needs the key before a byte of the body is read; every body is capped: an upload at
    ``max_upload`` bytes (plus its multipart framing), any other at ``max_body`` (a JSON request is at
    most one batch line). A declared length past the cap is refused at once, a chunked body as it passes."""

    def __init__(self, app: ASGIApp, key: str | None, max_upload: int, max_body: int) -> None:
        self.app, self.key, self.max_upload, self.max_body = app, key, max_upload, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if (path == "/v1" or path.startswith("/v1/")) and not key_ok(headers.get("authorization"), self.key,
                                                                       headers.get("x-api-key")):
            await unauthorized(path)(scope, receive, send)
            return
        upload = scope["method"] == "POST" and path in (UPLOAD_PATH, MESSAGE_BATCHES_PATH)
        cap = self.max_upload + UPLOAD_SLACK if upload else self.max_body
        try:
            declared = int(headers.get("content-length") or 0)
        except ValueError:
            declared = 0
        if declared > cap:
            await self._too_large(path, upload)(scope, receive, send)
            return
        await self._counted(scope, receive, send, cap, upload)

    async def _counted(self, scope: Scope, receive: Receive, send: Send, cap: int, upload: bool) -> None:
        seen = 0
        over = False

        async def counted() -> Message:
            nonlocal seen, over
            if over:
                return {"type": "http.disconnect"}
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > cap:
                over = True  # the route sees a disconnect; the 413 below is the answer
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
            await self._too_large(scope["path"], upload)(scope, receive, send)

    def _too_large(self, path: str, upload: bool) -> JSONResponse:
        if upload and path == UPLOAD_PATH:
            body = error_for(path, 413, f"the file is larger than {self.max_upload} bytes", code="file_too_large",
                             param="file")
        else:
            cap = self.max_upload if upload else self.max_body
            body = error_for(path, 413, f"the request body is larger than {cap} bytes", code="request_too_large")
        return JSONResponse(body, status_code=413)
