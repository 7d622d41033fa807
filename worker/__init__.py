"""The worker: one process per accelerator pulling jobs from Redis into the engine. Entry point: ``run_worker``."""

from worker.worker import WorkerReport, run_worker

__all__ = ["WorkerReport", "run_worker"]
