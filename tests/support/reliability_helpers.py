"""Helpers of the fault tests (test_reliability.py, test_engine_faults.py): a tiny engine, a worker in a thread
until a batch is final, the jobs still pending."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
from jobs_helpers import ThreadWorker, wait_for
from sluice.engine.llm import LLM
from sluice.jobs import keys
from sluice.jobs.store import get_batch


def tiny(model_dir: Path, cls: type = LLM, **kw: Any) -> Any:
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_num_seqs", 16)
    kw.setdefault("kv_cache_memory", 4 << 20)
    return cls(str(model_dir), **kw)


def final(r: redis.Redis, batch_id: str) -> bool:
    b = get_batch(r, batch_id)
    return b is not None and b.is_final


def run_to_end(r: redis.Redis, batch_id: str, llm: Any, timeout: float = 60) -> None:
    """A worker in a thread until the batch is final."""
    w = ThreadWorker(llm)
    try:
        wait_for(lambda: final(r, batch_id), timeout, f"batch {batch_id} to finish")
    finally:
        w.join()


def pending(r: redis.Redis, batch_id: str) -> int:
    prios = [int(p) for p in (r.hget(keys.meta(batch_id), "priorities") or "").split(",") if p]
    return sum(r.xpending(keys.jobs(batch_id, p), keys.GROUP)["pending"] for p in prios)
