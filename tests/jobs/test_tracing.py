"""OpenTelemetry traces (issue 47): one trace per job, across the submitting process (the API, or the CLI)
and the worker, its spans in the order of the job's path and linked to its ``sluice.submit`` span; no
span, and no import of opentelemetry, when tracing is off. Each process exports to one JSON-lines file
(``SLUICE_TRACES_FILE``, jobs/tracing.py); real ``sluice serve``, ``sluice submit`` and worker processes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from cli_api_helpers import run_sluice, start_sluice, stop, wait_for_url
from helpers import fresh_seed
from jobs_helpers import assert_exactly_once, prompt_lines, wait_for, worker_process
from reliability_helpers import final

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk (the dev extra) is absent")

pytest_plugins = ["jobs_fixtures"]

KEY = "sk-sluice-test"
PATH = ("sluice.submit", "sluice.enqueue", "sluice.claim", "sluice.admission", "sluice.first_token", "sluice.finish",
        "sluice.write_back")
TRACING_VARS = ("SLUICE_TRACING", "OTEL_TRACES_EXPORTER", "SLUICE_TRACES_FILE", "OTEL_SERVICE_NAME")


def untraced_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in TRACING_VARS}


def traced_env(spans: Path, service: str) -> dict[str, str]:
    return {**untraced_env(), "SLUICE_TRACING": "1", "SLUICE_TRACES_FILE": str(spans), "OTEL_SERVICE_NAME": service}


# redis-py (8.x) imports opentelemetry's metrics itself when it is installed: what counts is what Sluice's
# tracing adds to what its imports, redis included, brought.
OFF_PROBE = """
import sys
import redis, sluice.api.app, sluice.worker.worker
from sluice.jobs import tracing
from sluice.jobs.submit import submit
before = {m for m in sys.modules if m.startswith("opentelemetry")}
b = submit(['{"prompt": "a b c", "max_tokens": 2}'], model="tiny")
tracing.record("sluice.claim", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", 1.0, 2.0, {})
print(tracing.enabled(), bool({m for m in sys.modules if m.startswith("opentelemetry")} - before))
"""


@pytest.mark.parametrize("on", [False, True])
def test_off_means_no_span_and_no_import(r: redis.Redis, tmp_path: Path, on: bool) -> None:
    """A real submission in a fresh process: off, tracing imports nothing of opentelemetry and writes no
    span; on (the contrast: the probe can see it), both happen."""
    spans = tmp_path / "spans.jsonl"
    env = traced_env(spans, "probe") if on else {**untraced_env(), "SLUICE_TRACES_FILE": str(spans)}
    out = subprocess.run([sys.executable, "-c", OFF_PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == [str(on), str(on)]
    if on:
        names = [s["name"] for s in read_spans(spans)]
        assert sorted(names) == ["sluice.claim", "sluice.enqueue", "sluice.submit"]
    else:
        assert not spans.exists()


def read_spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def spans_file(tmp_path: Path) -> Path:
    return tmp_path / "spans.jsonl"


@pytest.fixture
def api(r: redis.Redis, tmp_path: Path, spans_file: Path) -> Iterator[tuple[httpx.Client, Any]]:
    log = tmp_path / "serve.log"
    env = {**traced_env(spans_file, "sluice-api"), "SLUICE_API_KEY": KEY, "SLUICE_FILES_DIR": str(tmp_path / "files")}
    proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log, env=env)
    try:
        url = wait_for_url(proc, log, timeout=60)
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            yield http, proc
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]


def api_batch(http: httpx.Client, lines: list[str]) -> str:
    bodies = [{k: v for k, v in json.loads(line).items() if k != "custom_id"} for line in lines]
    body = "\n".join(json.dumps({"custom_id": f"api-{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "tiny", **b}}) for i, b in enumerate(bodies))
    f = http.post("/v1/files", files={"file": ("in.jsonl", body.encode())}, data={"purpose": "batch"})
    assert f.status_code == 200, f.text
    b = http.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions",
                                       "completion_window": "24h"})
    assert b.status_code == 200, b.text
    return b.json()["id"]


def cli_batch(tmp_path: Path, name: str, lines: list[str], env: dict[str, str]) -> str:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = run_sluice("submit", str(src), "--model", "tiny", env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split()[-1]


def check_trace(spans: list[dict[str, Any]]) -> None:
    """One job's spans: each step once, in order, the worker's children of its sluice.submit."""
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == sorted(PATH) and len(spans) == len(PATH), [s["name"] for s in spans]
    root = by_name["sluice.submit"]
    assert root["parent_span_id"] is None
    assert all(s["parent_span_id"] == root["span_id"] for s in spans if s is not root)
    assert len({s["attributes"]["sluice.job_id"] for s in spans}) == 1
    submitter = {root["pid"], by_name["sluice.enqueue"]["pid"]}
    workers = {by_name[n]["pid"] for n in PATH[2:]}
    assert len(submitter) == 1 and len(workers) == 1 and submitter != workers  # across two processes
    assert root["start"] <= by_name["sluice.enqueue"]["start"] <= by_name["sluice.enqueue"]["end"] <= root["end"]
    # From the claim on, each step starts once the one before ended (the worker started after the submit).
    chain = [by_name[n] for n in PATH[1:]]
    for before, after in zip(chain, chain[1:], strict=False):
        assert before["end"] <= after["start"] <= after["end"], (before, after)


def test_one_trace_per_job_across_the_api_or_the_cli_and_the_worker(
        r: redis.Redis, api: tuple[httpx.Client, Any], spans_file: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    http, api_proc = api
    rng = random.Random(fresh_seed())
    from_api = api_batch(http, prompt_lines(3, rng, max_tokens=6))
    from_cli = cli_batch(tmp_path, "traced", prompt_lines(2, rng, max_tokens=6), traced_env(spans_file, "sluice-cli"))
    untraced = cli_batch(tmp_path, "untraced", prompt_lines(2, rng, max_tokens=6), untraced_env())
    log = tmp_path / "worker.log"
    os.environ.update(traced_env(spans_file, "sluice-worker"))  # worker_process passes the test's environment on
    try:
        p = worker_process(tiny_model_dir, "w1", "--exit-when-idle", "1", log=log)
    finally:
        for k in TRACING_VARS:
            os.environ.pop(k, None)
    try:
        wait_for(lambda: all(final(r, b) for b in (from_api, from_cli, untraced)) or p.poll() is not None, 600,
                 "the batches to finish")
        assert p.wait(timeout=120) == 0, log.read_text()[-3000:]  # its spans are flushed at exit
    finally:
        p.kill()
        p.wait()
    assert stop(api_proc) == 0  # the API's too
    for b, n in ((from_api, 3), (from_cli, 2), (untraced, 2)):
        assert {e["status"] for e in assert_exactly_once(r, b, n)} == {"completed"}

    spans = read_spans(spans_file)
    traces: dict[str, list[dict[str, Any]]] = {}
    for s in spans:
        traces.setdefault(s["trace_id"], []).append(s)
    jobs = {next(iter(t))["attributes"]["sluice.job_id"]: t for t in traces.values()}
    assert sorted(jobs) == sorted([f"{from_api}:{i}" for i in range(3)] + [f"{from_cli}:{i}" for i in range(2)])
    for trace in jobs.values():
        check_trace(trace)
    services = {(s["attributes"]["sluice.batch_id"], s["name"]): s["service"] for s in spans}
    assert services[(from_api, "sluice.submit")] == "sluice-api" and services[(from_cli, "sluice.submit")] == "sluice-cli"
    assert services[(from_api, "sluice.finish")] == "sluice-worker"
    assert not any(s["attributes"]["sluice.batch_id"] == untraced for s in spans)  # submitted with tracing off
