"""``GET /v1/backlog``: each model's jobs queued and in flight, the number an autoscaler (KEDA's
``metrics-api`` scaler, deploy/kubernetes/) scales a model's workers on. ``backlog`` counts held jobs
too, so it is zero only when no worker has a reason to live; a model with an open batch is listed
even while no worker serves it (scale from zero)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from sluice.api.state import Redis
from sluice.jobs.keys import queue_name
from sluice.jobs.store import list_workers, queue_backlog, queues_with_jobs

router = APIRouter(tags=["ops"])


@router.get("/v1/backlog", summary="Jobs queued and in flight per model (what an autoscaler reads)")
def backlog(r: Redis, model: Annotated[str | None, Query(description="Only this model's queue (its workers' "
                                                                     "--model)")] = None) -> dict[str, Any]:
    """With ``model``: ``{queue, queued, in_flight, backlog, workers}`` of that model's queue (zeros when it
    has no jobs). Without: ``{object: list, data: [...]}`` for every model with jobs or live workers."""
    workers = [w.queue_name for w in list_workers(r)]
    if model is not None:
        q = queue_name(model)
        return {**queue_backlog(r, q).to_dict(), "workers": workers.count(q)}
    queues = sorted(set(workers) | queues_with_jobs(r))
    return {"object": "list", "data": [{**queue_backlog(r, q).to_dict(), "workers": workers.count(q)}
                                       for q in queues]}
