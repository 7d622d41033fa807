"""Native single jobs: ``POST /v1/jobs`` queues one request (a one-job batch whose id starts ``job_``);
``GET /v1/jobs/{id}`` answers 200 with its status while it runs and its response once done."""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

import redis
from fastapi import APIRouter, Body
from sluice.api.errors import ApiError, not_found
from sluice.api.state import Redis, State
from sluice.api.validation import check_job, named_model
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.openai_output import result_to_output_line
from sluice.jobs.schemas import Batch
from sluice.jobs.store import cancel_batch, get_batch, read_results
from sluice.jobs.submit import UnknownModel, resolve_model, submit

router = APIRouter(tags=["jobs"])
JOB_PREFIX = "job_"

_EXAMPLE = {"custom_id": "q1", "messages": [{"role": "user", "content": "Name three rivers."}], "max_tokens": 64}


@router.post("/v1/jobs", summary="Queue one request")
def create_job(state: State, r: Redis, body: Annotated[dict[str, Any], Body(examples=[_EXAMPLE])]) -> dict[str, Any]:
    """The body is one line of a batch file: an OpenAI batch line (``custom_id``, ``method``, ``url``,
    ``body``) or a simple one (``prompt`` or ``messages``, sampling fields, optional ``custom_id``)."""
    text = json.dumps(body)
    try:
        job = parse_line(text, 1)
        check_job(job, state.settings.max_prompt_chars)
    except LineError as e:
        raise ApiError(400, e.message, code=e.code) from None
    try:
        queue = resolve_model(r, named_model(job))
    except UnknownModel as e:
        raise ApiError(400, str(e), code="model_not_found", param="model") from None
    batch = submit([text], r=r, model=queue, batch_id=f"{JOB_PREFIX}{uuid.uuid4().hex[:24]}",
                   metadata={"custom_id": job.custom_id})
    return job_object(r, batch)


@router.get("/v1/jobs/{job_id}", summary="A job's status, and its response once done")
def get_job(job_id: str, r: Redis) -> dict[str, Any]:
    return job_object(r, _job_batch(r, job_id))


@router.post("/v1/jobs/{job_id}/cancel", summary="Cancel a job")
def cancel_job(job_id: str, r: Redis) -> dict[str, Any]:
    _job_batch(r, job_id)
    batch = cancel_batch(r, job_id)
    if batch is None:
        raise not_found("job", job_id)
    return job_object(r, batch)


def _job_batch(r: redis.Redis, job_id: str) -> Batch:
    batch = get_batch(r, job_id, max_errors=0) if job_id.startswith(JOB_PREFIX) else None
    if batch is None:
        raise not_found("job", job_id)
    return batch


def job_object(r: redis.Redis, batch: Batch) -> dict[str, Any]:
    page = read_results(r, batch.id, "0", 1)
    res = page.results[0] if page.results else None
    line = result_to_output_line(None, res) if res is not None else None
    status = res.status if res is not None else "cancelling" if batch.status == "cancelling" else "in_progress"
    return {"id": batch.id, "object": "job", "status": status, "model": batch.model,
            "custom_id": batch.metadata.get("custom_id"), "created_at": int(batch.created_at),
            "completed_at": int(res.timings.finished) if res is not None and res.timings.finished else None,
            "response": line["response"] if line else None, "error": line["error"] if line else None}
