"""Prometheus metrics of one worker, on their own registry (several workers may share a process).

Names follow Prometheus' naming guide: a counter ends in ``_total`` (added by the client), a gauge never
does, a unit is spelled in the name, and rates are left to PromQL (``rate(sluice_generated_tokens_total[1m])``
is tokens/s). A concept the API also exports (``sluice_queued_jobs``, ``sluice_running_seqs``,
``sluice_job_server_up``) has the same name there, with a ``worker`` label here.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 24 * 3600)


class WorkerMetrics:
    def __init__(self, queue: str, worker_id: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"queue": queue, "worker": worker_id}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        self.queue_depth = gauge("sluice_queued_jobs", "Jobs of this model not yet delivered to any worker")
        self.running = gauge("sluice_running_seqs", "Sequences in the running batch")
        self.waiting = gauge("sluice_waiting_seqs", "Sequences waiting in the engine")
        self.held = gauge("sluice_held_jobs", "Jobs this worker holds (in the engine or about to be)")
        self.kv_used = gauge("sluice_kv_blocks_used", "KV cache blocks in use")
        self.kv_total = gauge("sluice_kv_blocks_capacity", "KV cache blocks in all")
        self.outbox = gauge("sluice_outbox_results", "Finished results not yet written (the job server unreachable)")
        self.redis_up = gauge("sluice_job_server_up", "1 while the job server (Redis) answers")
        self.write_errors = Counter("sluice_result_write_errors", "Result writes the job server refused (held and "
                                    "retried)", list(labels), registry=self.registry).labels(**labels)
        self.tokens = Counter("sluice_generated_tokens", "Generated tokens", list(labels),
                              registry=self.registry).labels(**labels)
        self.adapter_tokens = Counter("sluice_lora_generated_tokens", "Generated tokens per LoRA adapter",
                                      [*labels, "adapter"], registry=self.registry)
        self.jobs = Counter("sluice_jobs", "Job outcomes written by this worker", [*labels, "status"],
                            registry=self.registry)
        self.latency = Histogram("sluice_job_latency_seconds", "Submission to result", list(labels),
                                 buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**labels)
        self.run_time = Histogram("sluice_job_run_seconds", "Pulled by the worker to result", list(labels),
                                  buckets=_LATENCY_BUCKETS, registry=self.registry).labels(**labels)
        self._labels = labels
        self._write_errors = 0  # the session's total at the last observe
        self._server: Any = None

    def serve(self, port: int) -> None:
        self._server, _ = start_http_server(port, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def job_done(self, status: str, tokens: int, submitted: float | None, started: float | None,
                 adapter: str | None = None) -> None:
        now = time.time()
        self.jobs.labels(**self._labels, status=status).inc()
        if tokens:
            self.tokens.inc(tokens)
            if adapter is not None:
                self.adapter_tokens.labels(**self._labels, adapter=adapter).inc(tokens)
        if submitted:
            self.latency.observe(max(0.0, now - submitted))
        if started:
            self.run_time.observe(max(0.0, now - started))

    def observe(self, llm: Any, held: int, pending_writes: int, up: bool, queue_depth: int | None,
                write_errors: int) -> None:
        """One worker loop turn's gauges; ``write_errors`` is the session's running total."""
        self.engine(llm.num_running, llm.num_waiting, held, llm.num_free_blocks, llm.num_total_blocks)
        self.outbox.set(pending_writes)
        self.redis_up.set(1 if up else 0)
        if queue_depth is not None:
            self.queue_depth.set(queue_depth)
        self.write_errors.inc(write_errors - self._write_errors)
        self._write_errors = write_errors

    def engine(self, running: int, waiting: int, held: int, free_blocks: int, total_blocks: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.held.set(held)
        self.kv_used.set(total_blocks - free_blocks)
        self.kv_total.set(total_blocks)
