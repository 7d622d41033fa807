"""``run_worker``: build the engine, then serve a queue with it (the CLI's ``sluice worker`` and
``python -m sluice.worker`` call this)."""

from __future__ import annotations

import threading
from dataclasses import fields
from typing import Any

from sluice.engine.protocol import Engine
from sluice.jobs.keys import queue_name
from sluice.worker.options import WorkerOptions, WorkerReport
from sluice.worker.refusal import fail_waiting_jobs
from sluice.worker.worker import Worker


def run_worker(model: str | None = None, *, queue: str | None = None, stop_event: threading.Event | None = None,
               llm: Engine | None = None, **kwargs: Any) -> WorkerReport:
    """Serve ``queue`` (default: the model's name, None -> "default") until ``stop_event`` is set or
    SIGTERM/SIGINT (in the main thread) arrives; then drain within the grace period.

    ``kwargs`` naming WorkerOptions fields set those (its defaults are the only ones); the rest go to
    the engine (dtype, max_num_seqs, kv_cache_memory, ...). ``llm`` passes a ready engine instead. A
    model the engine refuses (UnsupportedModelError) fails the jobs waiting on the queue with the
    reason, then raises.
    """
    names = {f.name for f in fields(WorkerOptions)}
    engine_kwargs = {k: v for k, v in kwargs.items() if k not in names}
    o = WorkerOptions(queue=queue or queue_name(model), **{k: v for k, v in kwargs.items() if k in names})
    factory = None
    if llm is None:
        from sluice.engine.factory import build_engine
        from sluice.engine.models.base import UnsupportedModelError

        def factory() -> Engine:
            return build_engine(model, engine_kwargs)

        try:
            llm = factory()
        except UnsupportedModelError as e:  # no worker of this model ever will run them: fail its waiting jobs
            fail_waiting_jobs(o, str(e))
            raise
    return Worker(llm, o, stop_event, factory).run()

