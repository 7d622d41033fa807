"""OpenAI's Batches API (create from an uploaded file, retrieve, list, cancel) and the native
progressive results download."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field
from sluice.api.errors import ApiError, not_found
from sluice.api.filestore import error_file_id, output_file_id
from sluice.api.idempotency import IdempotencyKey, fingerprint, once
from sluice.api.state import Redis, State
from sluice.api.webhooks import check_batch_webhook
from sluice.jobs.embeddings import EMBEDDINGS_URL
from sluice.jobs.full import NOTHING_QUEUED, refused_when_full
from sluice.jobs.openai_output import result_to_output_line
from sluice.jobs.responses import RESPONSES_URL
from sluice.jobs.schemas import CHAT_URL, COMPLETIONS_URL, RESERVED_METADATA_PREFIX, Batch, LineErrorInfo
from sluice.jobs.scoring import RERANK_URL, SCORE_URL
from sluice.jobs.settings import MAX_DELIVERIES_KEY, parse_max_deliveries
from sluice.jobs.store import (
    cancel_batch,
    delete_batch,
    get_batch,
    page_batches,
    read_results,
    set_batch_options,
)
from sluice.jobs.submit import UnknownModel, resolve_model, submit
from sluice.jobs.units import parse_duration
from sluice.jobs.webhooks import WEBHOOK_METADATA_KEY

router = APIRouter(tags=["batches"])
ENDPOINTS = (CHAT_URL, COMPLETIONS_URL, EMBEDDINGS_URL, RESPONSES_URL, SCORE_URL, RERANK_URL)
CURSOR_PATTERN = r"^(0|\d{1,19}-\d{1,19})$"  # a results stream id (19 digits stay below 2**64)


class ExpiresAfter(BaseModel):
    """OpenAI's ``expires_after``: seconds after the file's creation (1 hour to 30 days)."""

    anchor: Literal["created_at"] = "created_at"
    seconds: int = Field(ge=3600, le=30 * 24 * 3600)


class BatchCreate(BaseModel):
    # Other fields OpenAI takes are accepted and change nothing.
    model_config = ConfigDict(extra="allow")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: ExpiresAfter | None = None  # of the batch's output and error files


def batch_object(batch: Batch) -> dict[str, Any]:
    """OpenAI's Batch object, with the output and error files once the batch is final."""
    return {**batch.to_openai(), "output_file_id": output_file_id(batch), "error_file_id": error_file_id(batch)}


def window_seconds(window: str) -> float:
    try:
        return parse_duration(window)
    except ValueError as e:
        raise ApiError(400, f"completion_window: {e}", code="invalid_window", param="completion_window") from None


def _check_metadata(metadata: dict[str, str] | None) -> None:
    for k, v in (metadata or {}).items():
        if len(k) > 64 or len(v) > 512:
            raise ApiError(400, "metadata keys are at most 64 characters and values at most 512",
                           code="invalid_metadata", param="metadata")
        if k == MAX_DELIVERIES_KEY:  # the one sluice_* key a client sets: checked, then the batch's jobs carry it
            _check_max_deliveries(v)
        elif k.lower().startswith(RESERVED_METADATA_PREFIX) and k != WEBHOOK_METADATA_KEY:
            raise ApiError(400, f"metadata key {k!r} is reserved (keys starting {RESERVED_METADATA_PREFIX!r} are "
                           "sluice's own)", code="invalid_metadata", param="metadata")


def _check_max_deliveries(value: str) -> None:
    try:
        parse_max_deliveries(value)
    except ValueError as e:
        raise ApiError(400, f"metadata {MAX_DELIVERIES_KEY}: {e}", code="invalid_metadata", param="metadata") from None


@router.post("/v1/batches", summary="Create a batch from an uploaded file")
def create_batch(body: BatchCreate, state: State, r: Redis, response: Response,
                 idempotency_key: IdempotencyKey = None) -> dict[str, Any]:
    return once(r, "batches", idempotency_key, lambda: fingerprint(body.model_dump(mode="json")),
                lambda: _create(body, state, r), lambda bid: _current(r, bid), response)


def _current(r: Redis, batch_id: str) -> dict[str, Any] | None:
    batch = get_batch(r, batch_id)
    return None if batch is None else batch_object(batch)


def _create(body: BatchCreate, state: State, r: Redis) -> dict[str, Any]:
    f = state.files.get_upload(body.input_file_id)
    if f is None:
        raise not_found("file", body.input_file_id)
    if f.meta["purpose"] != "batch":
        raise ApiError(400, "the input file was not uploaded with purpose=batch", param="input_file_id")
    if body.endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint {body.endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}",
                       code="unsupported_endpoint", param="endpoint")
    if f.info.get("endpoint") != body.endpoint:
        raise ApiError(400, f"the file's requests are for {f.info.get('endpoint')}, not {body.endpoint}",
                       code="endpoint_mismatch", param="endpoint")
    window = window_seconds(body.completion_window)
    _check_metadata(body.metadata)
    check_batch_webhook(body.metadata, state.settings)
    try:
        queue = resolve_model(r, f.info.get("model"))
    except UnknownModel as e:
        raise ApiError(400, str(e), code="model_not_found", param="model") from None
    try:
        # newline="\n": lines split as the upload check split them, whatever stray \r they hold.
        with f.path.open(encoding="utf-8", errors="replace", newline="\n") as src:
            batch = submit(src, r=r, model=queue, completion_window=window, metadata=body.metadata,
                           input_name=body.input_file_id, endpoint=body.endpoint,
                           line_errors=[LineErrorInfo(**e) for e in f.info.get("bad_lines", ())])
    except OSError:
        raise not_found("file", body.input_file_id) from None
    expires = body.output_expires_after.seconds if body.output_expires_after is not None else None
    with refused_when_full(NOTHING_QUEUED, lambda: delete_batch(r, batch.id)):  # its jobs go with it
        set_batch_options(r, batch.id, body.completion_window, expires)
    batch = batch.model_copy(update={"completion_window": body.completion_window, "output_expires_after": expires})
    return batch_object(batch)


@router.get("/v1/batches", summary="List batches, newest first (cursor pagination)")
def list_all(r: Redis, limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None) -> dict[str, Any]:
    found = page_batches(r, limit=limit, after=after)
    if found is None:
        raise not_found("batch", after or "")
    return found.to_openai(batch_object)


@router.get("/v1/batches/{batch_id}", summary="A batch's status, counts and files")
def retrieve(batch_id: str, r: Redis) -> dict[str, Any]:
    batch = get_batch(r, batch_id)
    if batch is None:
        raise not_found("batch", batch_id)
    return batch_object(batch)


@router.post("/v1/batches/{batch_id}/cancel", summary="Cancel a batch (finished results stay)")
def cancel(batch_id: str, r: Redis) -> dict[str, Any]:
    batch = cancel_batch(r, batch_id)
    if batch is None:
        raise not_found("batch", batch_id)
    if batch.status in ("completed", "failed", "expired"):
        raise ApiError(409, f"batch {batch_id} is already {batch.status}", code="batch_not_cancellable")
    return batch_object(batch)


@router.get("/v1/batches/{batch_id}/results", response_class=Response,
            responses={200: {"content": {"application/jsonl": {}}, "headers": {
                "Sluice-Cursor": {"description": "pass as `after` to read on", "schema": {"type": "string"}},
                "Sluice-Complete": {"description": "true once the batch is final and this page reached its end",
                                    "schema": {"type": "string"}}}}},
            summary="Results so far, in completion order, as OpenAI batch output lines (JSONL)")
def results(batch_id: str, r: Redis, after: Annotated[str, Query(pattern=CURSOR_PATTERN)] = "0",
            limit: Annotated[int, Query(ge=1, le=10_000)] = 1000) -> Response:
    """A progressive download: read until ``Sluice-Complete: true``, passing each page's ``Sluice-Cursor``
    back as ``after``. Failed, cancelled and expired jobs are here too (with ``error`` set)."""
    batch = get_batch(r, batch_id, max_errors=0)  # before the results: a final status means all are in
    if batch is None:
        raise not_found("batch", batch_id)
    page = read_results(r, batch_id, after, limit)
    settled = batch.is_final and batch.counts.done >= batch.counts.total
    body = "".join(json.dumps(result_to_output_line(None, res), ensure_ascii=False) + "\n" for res in page.results)
    headers = {"Sluice-Cursor": page.cursor, "Sluice-Complete": str(settled and len(page.results) < limit).lower(),
               "Sluice-Batch-Status": batch.status}
    return Response(body, media_type="application/jsonl", headers=headers)
