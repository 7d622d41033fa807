"""Running failed jobs again (issue 43): a batch's dead letters listed and requeued, and a finished batch's
failed and expired lines retried. ``jobs/reopen.py`` does the work; the CLI's twins are in cli/job_control_cmds.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sluice.api.errors import ApiError, not_found
from sluice.api.routes_batches import batch_object
from sluice.api.state import Redis
from sluice.jobs.reopen import Reopened, ReopenRefused, dead_letter_entries, requeue_dead_letters, retry_batch
from sluice.jobs.store import get_batch

router = APIRouter(tags=["batches"])


class Requeue(BaseModel):
    """Which dead letters: ``custom_ids``, or ``all``."""

    model_config = ConfigDict(extra="forbid")

    custom_ids: list[str] | None = Field(None, min_length=1, max_length=100_000)
    all: bool = False

    @model_validator(mode="after")
    def _one(self) -> Requeue:
        if self.all == (self.custom_ids is not None):
            raise ValueError("give custom_ids or all: true")
        return self


@router.get("/v1/batches/{batch_id}/dead_letters", summary="Jobs given up on after max deliveries")
def dead_letters(batch_id: str, r: Redis) -> dict[str, Any]:
    if get_batch(r, batch_id, max_errors=0) is None:
        raise not_found("batch", batch_id)
    return {"object": "list", "data": [dl.model_dump() for _, dl in dead_letter_entries(r, batch_id)]}


@router.post("/v1/batches/{batch_id}/requeue", summary="Run dead-lettered jobs again (same custom_ids)")
def requeue(batch_id: str, body: Requeue, r: Redis) -> dict[str, Any]:
    return _reopened(batch_id, lambda: requeue_dead_letters(r, batch_id, None if body.all else body.custom_ids))


@router.post("/v1/batches/{batch_id}/retry", summary="Run a finished batch's failed and expired lines again")
def retry(batch_id: str, r: Redis) -> dict[str, Any]:
    return _reopened(batch_id, lambda: retry_batch(r, batch_id))


def _reopened(batch_id: str, run: Callable[[], Reopened | None]) -> dict[str, Any]:
    try:
        done = run()
    except ReopenRefused as e:
        raise ApiError(409, str(e), code="batch_not_reopenable") from None
    if done is None:
        raise not_found("batch", batch_id)
    return {**batch_object(done.batch), "queued": done.queued, "not_retryable": done.not_retryable}
