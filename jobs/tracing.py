"""OpenTelemetry traces of a job's path, one trace per job across processes (off by default).

On when ``SLUICE_TRACING=1`` or ``OTEL_TRACES_EXPORTER`` names an exporter (not ``none``); off, nothing here
imports opentelemetry (the optional ``otel`` extra) and every hook returns at once. The spans, in order:

- ``sluice.submit`` (the API's or the CLI's process: from the submission's start until the job is queued) and its child
  ``sluice.enqueue`` (the round trip that writes it). Its W3C ``traceparent`` travels in the job's JSON.
- in the worker, children of ``sluice.submit``: ``sluice.claim`` (the read that delivered it),
  ``sluice.admission`` (waiting in the engine until the scheduler admits it), ``sluice.first_token``
  (prefill), ``sluice.finish`` (decoding to the last token), ``sluice.write_back`` (handed to the writer
  until its outcome is written). The worker's spans are recorded with the times the engine kept, when the
  job finishes (worker/worker.py and jobs/consumer/session.py call ``record``).

Exporting follows the standard variables: ``OTEL_TRACES_EXPORTER`` (default ``otlp``: install
``opentelemetry-exporter-otlp``; ``console``), ``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_SERVICE_NAME``,
``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``. ``SLUICE_TRACES_FILE=PATH`` appends each span as a JSON line to
PATH instead (a trace without a collector; the tests read it).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import Any

log = logging.getLogger(__name__)

ENV_ON = "SLUICE_TRACING"
ENV_FILE = "SLUICE_TRACES_FILE"
ENV_EXPORTER = "OTEL_TRACES_EXPORTER"
SERVICE = "sluice"  # the service name when OTEL_SERVICE_NAME gives none
SCOPE = "sluice"

_lock = threading.Lock()
_tracer: Any = None
_failed = False  # set up once and failed (an exporter not installed): stay off, said once


def enabled() -> bool:
    exporter = os.environ.get(ENV_EXPORTER, "").strip().lower()
    return os.environ.get(ENV_ON, "").strip() == "1" or exporter not in ("", "none")


def _exporter() -> Any:
    path = os.environ.get(ENV_FILE)
    if path:
        return _json_lines_exporter(path)
    name = os.environ.get(ENV_EXPORTER, "").strip().lower() or "otlp"
    found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
    if not found:
        raise RuntimeError(f"no OpenTelemetry traces exporter {name!r} is installed ({ENV_EXPORTER}; 'otlp' comes "
                           "with the opentelemetry-exporter-otlp package)")
    return found[0].load()()


def _setup() -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, which win over our default.
    resource = Resource({SERVICE_NAME: SERVICE}).merge(Resource.create())
    provider = TracerProvider(resource=resource)  # OTEL_TRACES_SAMPLER; flushed at exit
    provider.add_span_processor(BatchSpanProcessor(_exporter()))
    return provider.get_tracer(SCOPE)


def tracer() -> Any:
    """The process's tracer, set up on first use; None while tracing is off (or could not be set up)."""
    global _tracer, _failed
    if _tracer is not None or _failed or not enabled():
        return _tracer
    with _lock:
        if _tracer is None and not _failed:
            try:
                _tracer = _setup()
            except (ImportError, RuntimeError, OSError) as e:
                _failed = True
                log.error("tracing is off: %s", e)
    return _tracer


def _ns(t: float) -> int:
    return int(t * 1e9)


def job_attributes(job_id: str, batch_id: str | None, custom_id: str | None = None) -> dict[str, str]:
    out = {"sluice.job_id": job_id, "sluice.batch_id": batch_id or ""}
    if custom_id is not None:
        out["sluice.custom_id"] = custom_id
    return out


class Submitted:
    """The ``sluice.submit`` span of each job of a chunk being queued, ended once the chunk is written."""

    def __init__(self) -> None:
        self.spans: list[tuple[Any, dict[str, str]]] = []  # (span, the job's attributes)

    def start(self, job_id: str, batch_id: str | None, custom_id: str, start: float) -> str | None:
        """A new trace for the job; its traceparent (None: tracing is off)."""
        t = tracer()
        if t is None:
            return None
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # An empty context: a trace of its own, whatever span (an HTTP request's) is current.
        attrs = job_attributes(job_id, batch_id, custom_id)
        span = t.start_span("sluice.submit", context=context.Context(), start_time=_ns(start), attributes=attrs)
        self.spans.append((span, attrs))
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent")

    def take(self) -> Submitted:
        """This chunk's spans, handed to the flush that writes them; this one starts empty."""
        out = Submitted()
        out.spans, self.spans = self.spans, []
        return out

    def enqueued(self, start: float, end: float) -> None:
        if not self.spans:
            return
        from opentelemetry import trace

        t = tracer()
        for span, attrs in self.spans:
            child = t.start_span("sluice.enqueue", context=trace.set_span_in_context(span), start_time=_ns(start),
                                 attributes=attrs)
            child.end(end_time=_ns(end))
            span.end(end_time=_ns(end))
        self.spans = []


def record(name: str, traceparent: str | None, start: float | None, end: float | None,
           attributes: dict[str, Any]) -> None:
    """A span of the job's trace (a child of its ``sluice.submit``) with the times it had; nothing when
    tracing is off, the job carries no traceparent, or a time is unknown."""
    if traceparent is None or start is None or end is None:
        return
    t = tracer()
    if t is None:
        return
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    t.start_span(name, context=parent, start_time=_ns(start), attributes=attributes).end(end_time=_ns(max(start, end)))


def _json_lines_exporter(path: str) -> Any:
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class JsonLines(SpanExporter):
        """Each span as one JSON line appended to ``path`` (one write per batch: processes may share it)."""

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            lines = "".join(json.dumps(_span_dict(s)) + "\n" for s in spans)
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
            return SpanExportResult.SUCCESS

    return JsonLines()


def _span_dict(s: Any) -> dict[str, Any]:
    ctx = s.get_span_context()
    return {"name": s.name, "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
            "parent_span_id": f"{s.parent.span_id:016x}" if s.parent is not None else None,
            "start": s.start_time, "end": s.end_time, "attributes": dict(s.attributes or {}),
            "service": s.resource.attributes.get("service.name"), "pid": os.getpid(), "written": time.time()}
