"""Steering a batch: pause and resume (jobs/pause.py); the batch events sent to webhooks, with their deliveries
(jobs/webhooks.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from sluice.api.errors import ApiError, not_found
from sluice.api.routes_batches import batch_object
from sluice.api.state import Redis
from sluice.jobs.pause import NotPausable, pause_batch, resume_batch
from sluice.jobs.store import get_batch
from sluice.jobs.webhooks import batch_events, recent_events

router = APIRouter(tags=["batches"])


@router.post("/v1/batches/{batch_id}/pause", summary="Pause a batch: no new request of it goes to a worker")
def pause(batch_id: str, r: Redis, now: Annotated[bool, Query(description="Also put its running requests back in "
                                                                     "the queue, not counted as an attempt")] = False
          ) -> dict[str, Any]:
    """The batch's ``paused`` field is true until it is resumed; ``status`` stays one of OpenAI's."""
    try:
        batch = pause_batch(r, batch_id, now)
    except NotPausable as e:
        raise ApiError(409, str(e), code="batch_not_pausable") from None
    if batch is None:
        raise not_found("batch", batch_id)
    return batch_object(batch)


@router.post("/v1/batches/{batch_id}/resume", summary="Resume a paused batch")
def resume(batch_id: str, r: Redis) -> dict[str, Any]:
    batch = resume_batch(r, batch_id)
    if batch is None:
        raise not_found("batch", batch_id)
    return batch_object(batch)


@router.get("/v1/events", tags=["events"], summary="Batch events (batch.completed, ...) with their webhook deliveries")
def list_events(r: Redis, limit: Annotated[int, Query(ge=1, le=1000)] = 20) -> dict[str, Any]:
    """The events of the most recently finished batches, newest first: OpenAI's event objects, each with a
    ``delivery`` (state pending|delivered|failed|no_url|refused, attempts, url, last_error, times)."""
    return {"object": "list", "data": [e.to_dict() for e in recent_events(r, limit)]}


@router.get("/v1/batches/{batch_id}/events", tags=["events"], summary="A batch's events and their webhook deliveries")
def list_batch_events(batch_id: str, r: Redis) -> dict[str, Any]:
    if get_batch(r, batch_id, max_errors=0) is None:
        raise not_found("batch", batch_id)
    return {"object": "list", "data": [e.to_dict() for e in batch_events(r, batch_id)]}
