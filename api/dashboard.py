"""The dashboard: a page to watch bulk runs at ``/`` (batches, newest first, paged; live workers) and
``/batches/{id}`` (one batch: progress, rates over time, ETA, errors by code, downloads).

The two pages are shells without data. Their script (static/dashboard.js) fetches the fragments under
``/dashboard/`` with the API key the user typed (kept in the tab's sessionStorage, sent as the bearer
token, never in a URL) and swaps them in every few seconds. The fragments are rendered here from the
reads ``sluice status``/``sluice batches`` and ``/metrics`` make: ``page_batches``, ``count_batches``,
``get_batch``, ``recent_results`` with ``sluice.jobs.rates.rates``, ``list_workers``. Rates over time come
from the ring in api/rate_samples.py. A download link carries a signature that lasts a few minutes
(an HMAC keyed by the API key), never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import jinja2
import jinja2.sandbox
import redis
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse
from sluice.api.errors import ApiError, not_found
from sluice.api.gate import key_ok
from sluice.api.rate_samples import Point, RateSamples
from sluice.api.state import Redis, State, require_key
from sluice.jobs.openai_output import line_error_to_output_line, result_to_output_line
from sluice.jobs.rates import duration, rates
from sluice.jobs.schemas import Batch, Result, WorkerHeartbeat
from sluice.jobs.store import (
    count_batches,
    get_batch,
    get_line_errors,
    iter_results,
    list_workers,
    page_batches,
    queue_depth,
    recent_results,
)

HERE = Path(__file__).parent
PAGE_SIZE = 25  # batches per page of the list
ERROR_WINDOW = 1000  # the last results read for the error breakdown (never all of them)...
ERROR_WINDOW_MAX = 16_000  # ...reading further back, to this, while some of the batch's errors are not yet found
SAMPLES_PER_CODE = 3  # sample lines shown per error code
REFRESH_MS = 3000  # the page's polling interval
LINK_TTL = 600  # seconds a signed download link works, at least
LINK_STEP = 300
CHART_W, CHART_H = 600, 120
# No inline script or style, nothing from elsewhere: the page works offline and injected markup cannot run.
HEADERS = {"Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
                                      "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
           "Referrer-Policy": "no-referrer", "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
STATIC = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "favicon.svg": "image/svg+xml"}

router = APIRouter(include_in_schema=False)
auth = [Depends(require_key)]
# Sandboxed like every template sluice renders (its own pages here; it costs nothing and stays safe if
# a value ever reaches a template as code).
_env = jinja2.sandbox.SandboxedEnvironment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                                           trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
_samples_lock = threading.Lock()
Kind = Literal["output", "errors"]
KINDS: tuple[Kind, ...] = ("output", "errors")


# ---- the pages (no data, no key needed) -------------------------------------------------------------
@router.get("/", response_class=HTMLResponse)
def index_page() -> HTMLResponse:
    return _html("page.html", view="batches", batch_id="", title="Batches")


@router.get("/batches/{batch_id}", response_class=HTMLResponse)
def batch_page(batch_id: str) -> HTMLResponse:
    return _html("page.html", view="batch", batch_id=batch_id, title=batch_id)


@router.get("/dashboard/static/{name}")
def static_file(name: str) -> FileResponse:
    if name not in STATIC:
        raise not_found("file", name)
    return FileResponse(HERE / "static" / name, media_type=STATIC[name], headers={"Cache-Control": "no-cache"})


@router.get("/favicon.ico")
def favicon() -> FileResponse:
    """The icon, for what asks /favicon.ico without reading the pages' <link rel=icon> (an SVG either way)."""
    return static_file("favicon.svg")


@router.get("/dashboard/session")
def session(request: Request, state: State) -> JSONResponse:
    """Whether the server wants a key and whether this request's is it: 200 either way, so the page learns
    whether to show its login without a 401 in the browser's console."""
    h = request.headers
    key = state.settings.api_key
    authorized = key_ok(h.get("authorization"), key, h.get("x-api-key"))
    return JSONResponse({"key_required": key is not None, "authorized": authorized}, headers=HEADERS)


# ---- the fragments (the key needed) -----------------------------------------------------------------
@router.get("/dashboard/batches", dependencies=auth, response_class=HTMLResponse)
def batches_fragment(r: Redis, after: str | None = None,
                     limit: Annotated[int, Query(ge=1, le=100)] = PAGE_SIZE) -> HTMLResponse:
    t0 = time.perf_counter()
    page = page_batches(r, limit=limit, after=after)
    if page is None:
        return _html("missing.html", t0, status=404, what=f"No batch {after!r} to list after.")
    now = time.time()
    rows = [batch_row(b, now) for b in page.batches]
    return _html("batches.html", t0, rows=rows, total=count_batches(r), has_more=page.has_more,
                 after=after, last_id=page.batches[-1].id if page.batches else None)


@router.get("/dashboard/batches/{batch_id}", dependencies=auth, response_class=HTMLResponse)
def batch_fragment(batch_id: str, request: Request, state: State, r: Redis) -> HTMLResponse:
    t0 = time.perf_counter()
    batch = get_batch(r, batch_id)
    if batch is None:
        return _html("missing.html", t0, status=404, what=f"No batch {batch_id!r}.")
    now = time.time()
    speed = rates(batch, recent_results(r, batch.id), now)  # what `sluice status` shows
    window = _error_window(r, batch)
    points = _samples(request).observe(batch, now)
    links = {k: download_url(batch.id, k, state.settings.api_key, now) for k in KINDS}
    return _html("batch.html", t0, b=batch_row(batch, now), batch=batch, speed=speed,
                 eta=duration(speed.eta_s) if speed.eta_s is not None else "–",
                 errors=error_groups(batch, window), window=len(window), links=links,
                 charts=[chart("tokens/s", points, lambda p: p.tokens_per_s),
                         chart("requests/s", points, lambda p: p.jobs_per_s)])


@router.get("/dashboard/workers", dependencies=auth, response_class=HTMLResponse)
def workers_fragment(r: Redis) -> HTMLResponse:
    t0 = time.perf_counter()
    now = time.time()
    workers = [worker_row(w, now) for w in list_workers(r)]
    workers.sort(key=lambda w: (w["queue"], w["id"]))
    # Per model, as /metrics exports them: live workers, their running sequences, jobs not yet delivered.
    models = []
    for q in sorted({w["queue"] for w in workers}):
        mine = [w for w in workers if w["queue"] == q]
        models.append({"queue": q, "workers": len(mine), "running": sum(w["running"] for w in mine),
                       "queued": queue_depth(r, q)})
    return _html("workers.html", t0, workers=workers, models=models)


# ---- downloads (a signed link: a plain link cannot send the key) ------------------------------------
@router.get("/dashboard/batches/{batch_id}/{kind}.jsonl")
def download(batch_id: str, kind: Kind, state: State, r: Redis, expires: int = 0, sig: str = "") -> Response:
    key = state.settings.api_key
    if key is not None and not _signed(key, batch_id, kind, expires, sig):
        raise ApiError(401, "This download link is wrong or has expired; reload the dashboard for a fresh one.",
                       code="invalid_link")
    if get_batch(r, batch_id, max_errors=0) is None:
        raise not_found("batch", batch_id)
    return StreamingResponse(download_lines(r, batch_id, kind), media_type="application/jsonl",
                             headers={"Content-Disposition": f'attachment; filename="{batch_id}_{kind}.jsonl"',
                                      **HEADERS})


def download_url(batch_id: str, kind: Kind, key: str | None, now: float) -> str:
    url = f"/dashboard/batches/{batch_id}/{kind}.jsonl"
    if key is None:
        return url
    # Rounded up, so a link stays the same over several refreshes (a focused or hovered one stays put).
    expires = (int(now) // LINK_STEP + 1) * LINK_STEP + LINK_TTL
    return f"{url}?expires={expires}&sig={_sign(key, batch_id, kind, expires)}"


def _sign(key: str, batch_id: str, kind: str, expires: int) -> str:
    return hmac.new(key.encode(), f"download\0{batch_id}\0{kind}\0{expires}".encode(), hashlib.sha256).hexdigest()


def _signed(key: str, batch_id: str, kind: str, expires: int, sig: str) -> bool:
    # As bytes: compare_digest refuses a str with non-ASCII characters, which a URL can hold.
    return expires >= time.time() and hmac.compare_digest(sig.encode(), _sign(key, batch_id, kind, expires).encode())


def download_lines(r: redis.Redis, batch_id: str, kind: Kind) -> Iterator[str]:
    """The results so far as OpenAI batch output lines: the completed ones (``output``), or the bad input
    lines and the failed, cancelled and expired ones (``errors``); once the batch is final, the same
    lines as its output and error files."""
    if kind == "errors":
        for info in get_line_errors(r, batch_id):
            yield json.dumps(line_error_to_output_line(info), ensure_ascii=False) + "\n"
    for res in iter_results(r, batch_id):
        if (res.status == "completed") == (kind == "output"):
            yield json.dumps(result_to_output_line(None, res), ensure_ascii=False) + "\n"


# ---- what the templates show ------------------------------------------------------------------------
def batch_row(b: Batch, now: float) -> dict[str, Any]:
    c = b.counts
    ended = b.completed_at or b.cancelled_at or b.expired_at or b.failed_at
    return {"id": b.id, "status": b.status, "model": b.model, "done": c.done, "total": c.total,
            "completed": c.completed, "errors": c.done - c.completed, "invalid": c.invalid,
            "percent": 100.0 * c.done / c.total if c.total else (100.0 if b.is_final else 0.0),
            "created": stamp(b.created_at), "created_ago": duration(max(0.0, now - b.created_at)),
            "finished": stamp(ended) if b.is_final and ended else None, "paused": b.paused_at is not None}


def worker_row(w: WorkerHeartbeat, now: float) -> dict[str, Any]:
    total, free, beat = w.total_blocks, w.free_blocks, w.time
    prompt, cached = w.prompt_tokens, w.cached_tokens
    return {"id": w.id, "host": w.host, "queue": w.queue_name, "running": w.running, "waiting": w.waiting,
            "held": w.held, "kv_used": total - free, "kv_total": total,
            "kv_percent": 100.0 * (total - free) / total if total else 0.0,
            "beat_ago": duration(max(0.0, now - beat)) if beat else "-", "draining": w.draining,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "cache_percent": 100.0 * cached / prompt if prompt else None}


@dataclass
class ErrorGroup:
    code: str
    outcome: str  # failed, cancelled, expired, or "bad input line"
    seen: int = 0
    samples: list[tuple[str, str]] = field(default_factory=list)  # (custom_id or "line N", message)


def _error_window(r: redis.Redis, batch: Batch) -> list[Result]:
    """The last results, enough of them to hold every failed, cancelled and expired one when they lie
    within ERROR_WINDOW_MAX: early failures of a long batch would otherwise drop out of a fixed window
    as later results land."""
    c = batch.counts
    wanted, n = c.done - c.completed, ERROR_WINDOW
    while wanted > 0:
        window = recent_results(r, batch.id, n)
        if len(window) < n or n >= ERROR_WINDOW_MAX or sum(x.status != "completed" for x in window) >= wanted:
            return window
        n = min(4 * n, ERROR_WINDOW_MAX)
    return []


def error_groups(batch: Batch, window: list[Result]) -> list[ErrorGroup]:
    """Errors by code: the batch's first bad input lines (``get_batch`` keeps 20) and the failed, cancelled
    and expired results among its last ``ERROR_WINDOW``; codes as in the errors file."""
    groups: dict[tuple[str, str], ErrorGroup] = {}

    def add(code: str, outcome: str, label: str, message: str) -> None:
        g = groups.setdefault((code, outcome), ErrorGroup(code, outcome))
        g.seen += 1
        if len(g.samples) < SAMPLES_PER_CODE:
            g.samples.append((label, message))

    for e in batch.errors:
        add(e.code, "bad input line", f"line {e.line}", e.message)
    for res in reversed(window):  # newest first
        if res.status != "completed":
            err = result_to_output_line(None, res)["error"]
            add(err["code"], res.status, res.custom_id, err["message"])
    return sorted(groups.values(), key=lambda g: (-g.seen, g.code))


@dataclass
class Chart:
    label: str
    points: str  # an SVG polyline's points: one step per sample interval
    latest: float | None
    peak: float
    span: str


def chart(label: str, points: list[Point], value: Any) -> Chart:
    """A step line of ``value(point)`` over the sampled span, scaled to its peak."""
    if not points:
        return Chart(label, "", None, 0.0, "")
    t0, t1 = points[0].t0, points[-1].t
    peak = max(value(p) for p in points) or 1.0

    def xy(t: float, v: float) -> str:
        return f"{CHART_W * (t - t0) / (t1 - t0):.1f},{CHART_H - 4 - (CHART_H - 8) * v / peak:.1f}"

    steps = " ".join(f"{xy(p.t0, value(p))} {xy(p.t, value(p))}" for p in points)
    return Chart(label, steps, value(points[-1]), peak, duration(t1 - t0))


def stamp(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _samples(request: Request) -> RateSamples:
    with _samples_lock:  # one ring per app: tests build several apps in one process
        if not hasattr(request.app.state, "dashboard_samples"):
            request.app.state.dashboard_samples = RateSamples()
        return request.app.state.dashboard_samples


def _html(template: str, t0: float | None = None, status: int = 200, **context: Any) -> HTMLResponse:
    body = _env.get_template(template).render(refresh_ms=REFRESH_MS, chart_w=CHART_W, chart_h=CHART_H, **context)
    headers = dict(HEADERS)
    if t0 is not None:  # the server's time for the fragment: the Redis reads and the rendering
        headers["Server-Timing"] = f"app;dur={1000 * (time.perf_counter() - t0):.1f}"
    return HTMLResponse(body, status_code=status, headers=headers)
