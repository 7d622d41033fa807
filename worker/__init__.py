"""The worker: one process per accelerator pulling jobs from the queue into the engine. Entry point: ``run_worker``."""

from sluice.worker.options import WorkerReport
from sluice.worker.run import run_worker

__all__ = ["WorkerReport", "run_worker"]
