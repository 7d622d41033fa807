"""The worker heartbeat is one model (jobs/schemas.WorkerHeartbeat): a real worker writes exactly its
fields, every reader (list_workers, the API's models and backlog, the dashboard) reads it back, and a
stray value under a heartbeat key does not break the listing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import redis
from jobs_helpers import ThreadWorker, wait_for
from sluice.jobs import keys
from sluice.jobs.schemas import WorkerHeartbeat
from sluice.jobs.store import list_workers, served_kinds

pytest_plugins = ["jobs_fixtures"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Any:
    from sluice.engine.llm import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=4, kv_cache_memory=4 << 20)


def test_a_real_workers_heartbeat_is_the_model(r: redis.Redis, llm: Any) -> None:
    from sluice.api.dashboard import worker_row

    r.set(keys.heartbeat("stray"), "1", ex=60)  # not a heartbeat: skipped, not a crash
    w = ThreadWorker(llm, worker_id="hb")
    try:
        raw = wait_for(lambda: r.get(keys.heartbeat("hb")), 30, "the heartbeat")
        fields = set(json.loads(raw))
        assert fields == set(WorkerHeartbeat.model_fields), (
            f"the worker writes {sorted(fields - set(WorkerHeartbeat.model_fields))} the model lacks, "
            f"lacks {sorted(set(WorkerHeartbeat.model_fields) - fields)}")
        (beat,) = list_workers(r)
        assert (beat.id, beat.queue, beat.serves, beat.total_blocks) == ("hb", "tiny", "generation", llm.num_total_blocks)
        assert served_kinds(r) == {"tiny": {"generation"}}
        assert worker_row(beat, beat.time)["kv_total"] == llm.num_total_blocks
    finally:
        w.join()
    assert r.get(keys.heartbeat("hb")) is None  # signed off: nothing left behind
    r.delete(keys.heartbeat("stray"))


def test_an_older_workers_heartbeat_reads_with_defaults() -> None:
    beat = WorkerHeartbeat.read(json.dumps({"id": "old", "host": "h", "pid": 1, "time": 1.0, "future_field": 3}))
    assert beat is not None and (beat.serves, beat.queue_name, beat.adapters) == ("generation", "default", [])
