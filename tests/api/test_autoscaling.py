"""Scaling workers on the backlog (issue 47): what KEDA reads (``GET /v1/backlog``, the ``sluice_queued_jobs``
and ``sluice_in_flight_jobs`` gauges) rises with submitted jobs while no worker lives and falls to zero
only once they finish; a worker started with ``--exit-when-idle`` exits only when it holds nothing, and a
job submitted as it exits is taken by the next worker. Real ``sluice serve``, real worker processes, the
embedded server."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis
from cli_api_helpers import served_client
from helpers import fresh_seed
from jobs_helpers import assert_exactly_once, held_by, prompt_lines, result_entries, wait_for, worker_process
from reliability_helpers import final
from sluice.jobs import keys
from sluice.jobs.submit import submit

pytest_plugins = ["jobs_fixtures"]

KEY = "sk-sluice-test"


@pytest.fixture
def api(r: redis.Redis, tmp_path: Path) -> Iterator[httpx.Client]:
    with served_client(tmp_path, KEY) as http:
        yield http


def backlog(api: httpx.Client, model: str = "tiny") -> dict[str, int]:
    got = api.get("/v1/backlog", params={"model": model})
    assert got.status_code == 200, got.text
    return got.json()


def gauge(text: str, name: str, queue: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f'{name}{{queue="{queue}"}} '):
            return float(line.rpartition(" ")[2])
    return None


def test_the_backlog_rises_with_jobs_before_any_worker_and_falls_to_zero_when_they_finish(
        r: redis.Redis, api: httpx.Client, tiny_model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    assert backlog(api) == {"queue": "tiny", "queued": 0, "in_flight": 0, "backlog": 0, "workers": 0}
    assert api.get("/v1/backlog", headers={"Authorization": "Bearer wrong"}).status_code == 401
    b1 = submit(prompt_lines(5, rng, max_tokens=200), r=r, model="tiny")
    b2 = submit(prompt_lines(3, rng, max_tokens=200), r=r, model="tiny")
    # No worker lives: the queue is reported all the same (KEDA starts the first worker on it).
    assert backlog(api) == {"queue": "tiny", "queued": 8, "in_flight": 0, "backlog": 8, "workers": 0}
    listed = api.get("/v1/backlog").json()["data"]
    assert [q for q in listed if q["queue"] == "tiny"] == [{**backlog(api)}]
    metrics = api.get("/metrics").text
    assert gauge(metrics, "sluice_queued_jobs", "tiny") == 8 and gauge(metrics, "sluice_in_flight_jobs", "tiny") == 0
    assert gauge(metrics, "sluice_live_workers", "tiny") == 0

    log = tmp_path / "worker.log"
    p = worker_process(tiny_model_dir, "w1", "--exit-when-idle", "1", log=log, paced=True)
    try:
        # Held jobs still count: scaling down must not take the worker that runs them.
        wait_for(lambda: held_by(r, b1.id, "w1") + held_by(r, b2.id, "w1") > 0 or p.poll() is not None, 300,
                 f"the worker to hold jobs (its log: {log})")
        assert p.poll() is None, log.read_text()[-3000:]
        seen = backlog(api)
        assert seen["in_flight"] > 0 and seen["backlog"] == 8 - r.hlen(keys.done(b1.id)) - r.hlen(keys.done(b2.id))
        wait_for(lambda: final(r, b1.id) and final(r, b2.id), 300, "both batches to finish")
        assert backlog(api)["backlog"] == 0
        assert p.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        p.kill()
        p.wait()
    assert_exactly_once(r, b1.id, 5)
    assert_exactly_once(r, b2.id, 3)
    assert backlog(api) == {"queue": "tiny", "queued": 0, "in_flight": 0, "backlog": 0, "workers": 0}


def test_an_idle_worker_exits_holding_nothing_and_the_next_worker_takes_a_job_submitted_as_it_exits(
        r: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> None:
    """Its jobs run longer than its idle limit (paced steps): it exits only after all are written; a batch
    submitted the moment it starts draining is left whole in the queue, and the next worker runs it."""
    rng = random.Random(fresh_seed())
    first = submit(prompt_lines(4, rng, max_tokens=120), r=r, model="tiny")
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = worker_process(tiny_model_dir, "a", "--exit-when-idle", "0.5", log=log_a, paced=True)
    try:
        wait_for(lambda: "draining" in log_a.read_text() or a.poll() is not None, 600, "worker a to go idle")
        second = submit(prompt_lines(3, rng, max_tokens=4), r=r, model="tiny")  # as it exits
        assert a.wait(timeout=60) == 0, log_a.read_text()[-3000:]
    finally:
        a.kill()
        a.wait()
    assert final(r, first.id)  # all of its jobs written before it went
    assert {e["worker"] for e in assert_exactly_once(r, first.id, 4)} == {"a"}
    assert {e["status"] for e in result_entries(r, first.id)} == {"completed"}
    assert "releasing" not in log_a.read_text()  # it handed nothing back: it held nothing
    assert not final(r, second.id) and held_by(r, second.id, "a") == 0
    b = worker_process(tiny_model_dir, "b", "--exit-when-idle", "0.5", log=log_b)
    try:
        wait_for(lambda: final(r, second.id), 300, "the next worker to run the batch")
        assert b.wait(timeout=60) == 0, log_b.read_text()[-3000:]
    finally:
        b.kill()
        b.wait()
    entries = assert_exactly_once(r, second.id, 3)
    assert {(e["worker"], e["status"]) for e in entries} == {("b", "completed")}
