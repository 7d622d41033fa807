"""A pipeline stage for the Celery tests, loaded by their Celery worker (``--include celery_stages``).

It notes in a Redis list that it ran, and what its batch looked like at that moment (status, results
written, total), so a test can tell how often a completion signature fired and whether every result
was in before it did. It returns the batch id, so stages chain. No tests here, and no test_ prefix:
pytest would collect the module and, reading its names, evaluate the task and Celery's config.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sluice.jobs import keys
from sluice.jobs.celery_app import _redis, app

FIRED = "test:celery:fired"


@app.task(name="test.stage")
def stage(batch_id: str, name: str) -> str:
    r = _redis()
    status, total = r.hmget(keys.meta(batch_id), "status", "total")
    r.rpush(FIRED, json.dumps({"stage": name, "batch_id": batch_id, "status": status, "total": int(total or 0),
                               "results": r.xlen(keys.results(batch_id)), "pid": os.getpid()}))
    return batch_id


def fired(r: Any, batch_id: str) -> list[dict[str, Any]]:
    """The stage runs noted for ``batch_id``, in order."""
    return [x for x in (json.loads(v) for v in r.lrange(FIRED, 0, -1)) if x["batch_id"] == batch_id]
