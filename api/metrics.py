"""``GET /metrics``: the API's request counts, and the job plane as seen at scrape time (live workers,
jobs queued and in flight per model, read from Redis; a model with an open batch is reported with no
worker alive too, the signal an autoscaler starts its first worker on), on the API's own Prometheus registry. Names as in
``sluice.worker.metrics`` (the same concept has the same name; the workers add a ``worker`` label)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sluice.jobs.schemas import WorkerHeartbeat
from sluice.jobs.store import Backlog, list_workers, queue_backlog, queues_with_jobs

READ_EVERY = 5.0  # seconds a reading of the job plane is reused: scrapes must not each SCAN Redis
# A label's values must be a set fixed in advance: every new value is a series kept for the process's
# life, so a method token or a path taken from the request would let any client grow /metrics at will.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER = "other"


def _families() -> tuple[GaugeMetricFamily, ...]:
    return (GaugeMetricFamily("sluice_job_server_up", "1 while the job server (Redis) answers"),
            GaugeMetricFamily("sluice_live_workers", "Workers with a live heartbeat", labels=["queue"]),
            GaugeMetricFamily("sluice_running_seqs", "Sequences running over live workers", labels=["queue"]),
            GaugeMetricFamily("sluice_queued_jobs", "Jobs not yet delivered to any worker", labels=["queue"]),
            GaugeMetricFamily("sluice_in_flight_jobs", "Jobs a worker holds, not yet written back", labels=["queue"]))


class JobPlaneCollector(Collector):
    def __init__(self, get_redis: Callable[[], redis.Redis]) -> None:
        self.get_redis = get_redis
        self._reading: tuple[list[WorkerHeartbeat], dict[str, Backlog]] | None = None
        self._read_at = -math.inf

    def _read(self) -> tuple[list[WorkerHeartbeat], dict[str, Backlog]]:
        if self._reading is None or time.monotonic() - self._read_at > READ_EVERY:
            r = self.get_redis()
            workers = list_workers(r)
            queues = {w.queue_name for w in workers} | queues_with_jobs(r) | {"default"}
            self._reading = workers, {q: queue_backlog(r, q) for q in sorted(queues)}
            self._read_at = time.monotonic()
        return self._reading

    def describe(self) -> Iterator[Any]:
        """The names, without reading Redis (the registry asks at registration)."""
        yield from _families()

    def collect(self) -> Iterator[Any]:
        up, live, running, depth, in_flight = _families()
        try:
            workers, depths = self._read()
        except (redis.RedisError, OSError, RuntimeError):
            self._reading = None
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        for q, n in depths.items():
            mine = [w for w in workers if w.queue_name == q]
            live.add_metric([q], len(mine))
            running.add_metric([q], sum(w.running for w in mine))
            depth.add_metric([q], n.queued)
            in_flight.add_metric([q], n.in_flight)
        yield from (live, running, depth, in_flight)


def request_labels(scope: MutableMapping[str, Any], status: int) -> tuple[str, str, str]:
    """A request's ``method``, ``route`` and ``status`` labels, each from a bounded set: a known method
    or ``other``; the matched route's template (never the raw path) or ``other``; a valid status code."""
    method = scope.get("method", "")
    route = getattr(scope.get("route"), "path", None)
    return (method if method in METHODS else OTHER, route if isinstance(route, str) else OTHER,
            str(status) if 100 <= status <= 599 else OTHER)


def make_registry(get_redis: Callable[[], redis.Redis]) -> tuple[CollectorRegistry, Counter]:
    registry = CollectorRegistry()
    registry.register(JobPlaneCollector(get_redis))
    requests = Counter("sluice_api_requests", "HTTP requests answered", ["method", "route", "status"],
                       registry=registry)
    return registry, requests


# Seconds, from a fast interactive answer on a GPU to a long generation behind a busy queue.
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class OpenAIMetrics:
    """The interactive endpoints' latency (request in to last byte out, by endpoint, streamed or not, and
    outcome) and, for streams, the time to the first token."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.latency = Histogram("sluice_api_request_latency_seconds", "Interactive requests: seconds to the answer",
                                 ["endpoint", "stream", "status"], buckets=LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("sluice_api_time_to_first_token_seconds", "Streamed requests: seconds to the first text",
                              ["endpoint"], buckets=LATENCY_BUCKETS, registry=registry)
