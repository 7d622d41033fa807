"""OpenAI's Files API: upload a batch input file, read a file's object and content, list, delete."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Any, Literal

import redis
from fastapi import APIRouter, File, Form, Query, Response, UploadFile
from fastapi.responses import FileResponse
from sluice.api.errors import ApiError, not_found
from sluice.api.filestore import ERRORS_PREFIX, OUTPUT_PREFIX, UPLOAD_TTL, DiskFull, TooLarge
from sluice.api.idempotency import IdempotencyKey, fingerprint, once
from sluice.api.state import Redis, State
from sluice.api.validation import bounded_lines, max_line_bytes, scan_lines
from starlette.concurrency import run_in_threadpool

router = APIRouter(tags=["files"])
JSONL = "application/jsonl"


@router.post("/v1/files", summary="Upload a batch input file (JSONL, purpose=batch)")
async def upload_file(state: State, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()],
                      response: Response, idempotency_key: IdempotencyKey = None,
                      anchor: Annotated[str | None, Form(alias="expires_after[anchor]")] = None,
                      seconds: Annotated[int | None, Form(alias="expires_after[seconds]")] = None) -> dict[str, Any]:
    if purpose != "batch":
        raise ApiError(400, f"purpose {purpose!r} is not supported; only 'batch' is", code="unsupported_purpose",
                       param="purpose")
    if anchor not in (None, "created_at") or (seconds is not None and not 3600 <= seconds <= 30 * 24 * 3600):
        raise ApiError(400, "expires_after needs anchor 'created_at' and seconds between 3600 and 2592000",
                       code="invalid_expires_after", param="expires_after")
    # Copying and checking every line is blocking work: off the event loop.
    return await run_in_threadpool(_store_upload, state, file, purpose, seconds or UPLOAD_TTL, idempotency_key,
                                   response)


def _store_upload(state: State, file: UploadFile, purpose: str, ttl: float, key: str | None,
                  response: Response) -> dict[str, Any]:
    try:
        tmp = state.files.receive(file.file, state.settings.max_upload_bytes)
    except TooLarge as e:
        raise ApiError(413, str(e), code="file_too_large", param="file") from None
    except DiskFull as e:
        raise _insufficient_storage(e) from None
    if key is None:
        return _keep_upload(state, tmp, file.filename, purpose, ttl)
    r = state.redis()
    try:
        return once(r, "files", key, lambda: fingerprint(purpose, ttl, file.filename, _sha256(tmp)),
                    lambda: _keep_upload(state, tmp, file.filename, purpose, ttl), lambda fid: _current(state, r, fid),
                    response, lambda: tmp.unlink(missing_ok=True))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _current(state: State, r: redis.Redis, file_id: str) -> dict[str, Any] | None:
    f = state.files.get(r, file_id)
    return None if f is None else f.public()


def _keep_upload(state: State, tmp: Path, filename: str | None, purpose: str, ttl: float) -> dict[str, Any]:
    s = state.settings
    try:
        with tmp.open("rb") as src:
            scan = scan_lines(bounded_lines(src, max_line_bytes(s.max_prompt_chars)), s.max_batch_lines,
                              s.max_prompt_chars)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    info = {"lines": scan.lines, "model": scan.model, "endpoint": scan.endpoint,
            "bad_lines": [e.model_dump() for e in scan.errors]}
    try:
        return state.files.add(tmp, filename or "input.jsonl", purpose, info, ttl).public()
    except DiskFull as e:
        raise _insufficient_storage(e) from None


def _insufficient_storage(e: DiskFull) -> ApiError:
    return ApiError(507, f"{e}; nothing was kept: free space on the server's files directory and upload again",
                    code="insufficient_storage", param="file")


@router.get("/v1/files", summary="List uploaded files (newest first unless order=asc)")
def list_files(state: State, limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000, after: str | None = None,
               purpose: str | None = None, order: Literal["asc", "desc"] = "desc") -> dict[str, Any]:
    state.files.delete_expired()
    files = [f for f in state.files.list_uploads() if purpose is None or f.meta["purpose"] == purpose]
    if order == "asc":
        files.reverse()
    if after is not None:
        ids = [f.meta["id"] for f in files]
        if after not in ids:
            raise not_found("file", after)
        files = files[ids.index(after) + 1:]
    page = [f.public() for f in files[:limit]]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(files) > limit}


@router.get("/v1/files/{file_id}", summary="A file's object (input, or a batch's output or error file)")
def get_file(file_id: str, state: State, r: Redis) -> dict[str, Any]:
    f = state.files.get(r, file_id)
    if f is None:
        raise not_found("file", file_id)
    return f.public()


@router.get("/v1/files/{file_id}/content", summary="A file's bytes",
            responses={200: {"content": {JSONL: {}}}}, response_class=FileResponse)
def get_file_content(file_id: str, state: State, r: Redis) -> FileResponse:
    f = state.files.get(r, file_id)
    if f is None or not f.path.exists():
        raise not_found("file", file_id)
    return FileResponse(f.path, media_type=JSONL, filename=f.meta["filename"])


@router.delete("/v1/files/{file_id}", summary="Delete an uploaded file")
def delete_file(file_id: str, state: State) -> dict[str, Any]:
    if file_id.startswith((OUTPUT_PREFIX, ERRORS_PREFIX)):
        raise ApiError(400, "a batch's output and error files go with the batch", code="not_deletable",
                       param="file_id")
    if not state.files.delete_upload(file_id):
        raise not_found("file", file_id)
    return {"id": file_id, "object": "file", "deleted": True}
