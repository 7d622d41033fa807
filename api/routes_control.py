"""Steering a batch: pause and resume (jobs/pause.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from sluice.api.errors import ApiError, not_found
from sluice.api.routes_batches import batch_object
from sluice.api.state import Redis
from sluice.jobs.pause import NotPausable, pause_batch, resume_batch

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
