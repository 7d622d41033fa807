"""Pausing a batch (issue 43, item 4) on the real embedded server, with real workers (`python -m sluice.worker`,
paced so a batch is still running when the test acts) and a live `sluice serve` over HTTP: a paused batch hands
out nothing more while another batch runs, `--now` puts its running jobs back uncharged, and a worker killed -9
while its batch is paused leaves its jobs to be claimed after the resume, each job with exactly one outcome."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from cli_api_helpers import run_sluice, serving, sluice_home
from helpers import fresh_seed
from jobs_helpers import assert_exactly_once, held_by, prompt_lines, wait_for, worker_process
from sluice.jobs import keys
from sluice.jobs.connection import connect
from sluice.jobs.pause import pause_batch, resume_batch
from sluice.jobs.store import get_batch, priorities
from sluice.jobs.submit import submit

KEY = "sk-pause"
SLOW = ("--max-num-seqs", "2", "--lookahead", "0")  # two jobs at a time: most of a batch is still queued


@dataclass
class Live:
    url: str
    home: Path
    r: redis.Redis

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("pause") / "home"
    with sluice_home(home):
        with serving(home.parent / "serve.log", KEY) as url:
            r = connect()
            try:
                yield Live(url, home, r)
            finally:
                r.close()


def handed_out(r: redis.Redis, batch_id: str) -> int:
    """Jobs of the batch a worker ever got: those with an outcome plus those pending, read atomically."""
    pipe = r.pipeline(transaction=True)
    pipe.hlen(keys.done(batch_id))
    for p in priorities(r, batch_id):
        pipe.xpending(keys.jobs(batch_id, p), keys.GROUP)
    done, *summaries = pipe.execute()
    return int(done) + sum(int(s["pending"]) for s in summaries)


def pending(r: redis.Redis, batch_id: str) -> int:
    return handed_out(r, batch_id) - r.hlen(keys.done(batch_id))


def is_final(r: redis.Redis, batch_id: str) -> bool:
    b = get_batch(r, batch_id)
    return b is not None and b.is_final


def all_completed(r: redis.Redis, batch_id: str, total: int) -> None:
    entries = assert_exactly_once(r, batch_id, total)
    assert {e["status"] for e in entries} == {"completed"}, [e for e in entries if e["status"] != "completed"][:3]
    assert r.xlen(keys.dead(batch_id)) == 0


def start_worker(live: Live, model: Path, wid: str, *args: str) -> Any:
    return worker_process(model, wid, *SLOW, *args, log=live.home.parent / f"{wid}.log", paced=True)


def test_a_paused_batch_hands_out_nothing_while_another_runs(live: Live, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    r, n = live.r, 40
    a = submit(prompt_lines(n, rng, max_tokens=8), r=r, model="tiny")
    p = start_worker(live, tiny_model_dir, "pause-1")
    try:
        wait_for(lambda: r.hlen(keys.done(a.id)) >= 4, 120, "a few of A's jobs done")
        with live.http() as http:
            got = http.post(f"/v1/batches/{a.id}/pause")
            assert got.status_code == 200, got.text
            body = got.json()
            assert (body["status"], body["paused"]) == ("in_progress", True) and body["paused_at"] > 0
            handed = handed_out(r, a.id)
            assert handed < n
            assert "status-paused" in http.get(f"/dashboard/batches/{a.id}").text  # the dashboard says so
            assert "status-paused" in http.get("/dashboard/batches").text
        b = submit(prompt_lines(12, rng, max_tokens=8), r=r, model="tiny")
        wait_for(lambda: is_final(r, b.id), 120, "B to finish while A is paused")
        wait_for(lambda: pending(r, a.id) == 0, 60, "A's running jobs to finish")
        assert handed_out(r, a.id) == handed == r.hlen(keys.done(a.id))  # nothing more went to the worker
        assert get_batch(r, a.id).status == "in_progress"
        out = run_sluice("status", a.id)
        assert out.returncode == 0 and "paused since" in out.stdout, out.stdout + out.stderr

        out = run_sluice("resume", a.id)
        assert out.returncode == 0 and "resumed" in out.stdout, out.stderr
        wait_for(lambda: is_final(r, a.id), 120, "A to finish once resumed")
        assert get_batch(r, a.id).paused_at is None
        all_completed(r, a.id, n)
        all_completed(r, b.id, 12)
    finally:
        p.kill()
        p.wait()


def test_pause_now_puts_running_jobs_back_uncharged(live: Live, tiny_model_dir: Path) -> None:
    """With --max-deliveries 1 a job charged for its hand-back would be dead-lettered on its next delivery."""
    rng = random.Random(fresh_seed())
    r, n, wid = live.r, 24, "pause-2"
    a = submit(prompt_lines(n, rng, max_tokens=16), r=r, model="tiny")
    p = start_worker(live, tiny_model_dir, wid, "--max-deliveries", "1")
    try:
        wait_for(lambda: r.hlen(keys.done(a.id)) >= 2 and held_by(r, a.id, wid) > 0, 120, "A running")
        out = run_sluice("pause", "--now", a.id)
        assert out.returncode == 0 and "paused" in out.stdout, out.stderr
        wait_for(lambda: pending(r, a.id) == 0, 60, "the running jobs handed back")
        done = r.hlen(keys.done(a.id))
        assert done < n
        stream = keys.jobs(a.id, 0)
        back = [f for _, f in r.xrange(stream)]
        assert len(back) == n - done and all(int(f.get("a") or 0) == 0 for f in back), back  # no attempt counted
        time.sleep(1.0)  # the worker keeps polling: still nothing of A taken
        assert handed_out(r, a.id) == r.hlen(keys.done(a.id)) == done

        with live.http() as http:
            got = http.post(f"/v1/batches/{a.id}/resume")
        assert got.status_code == 200 and got.json()["paused"] is False, got.text
        wait_for(lambda: is_final(r, a.id), 120, "A to finish once resumed")
        all_completed(r, a.id, n)
    finally:
        p.kill()
        p.wait()


def test_worker_killed_while_its_batch_is_paused(live: Live, tiny_model_dir: Path) -> None:
    """Its jobs stay pending under the dead worker while paused (no claim hands them out), and are
    claimed and finished after the resume: each job one outcome."""
    rng = random.Random(fresh_seed())
    r, n, dead = live.r, 30, "pause-3"
    a = submit(prompt_lines(n, rng, max_tokens=16), r=r, model="tiny")
    p = start_worker(live, tiny_model_dir, dead)
    q = None
    try:
        wait_for(lambda: r.hlen(keys.done(a.id)) >= 2 and held_by(r, a.id, dead) > 0, 120, "A running")
        assert pause_batch(r, a.id).paused_at is not None
        p.kill()  # SIGKILL: no hand-back, no sign-off
        p.wait()
        held, done = held_by(r, a.id, dead), r.hlen(keys.done(a.id))
        assert held > 0
        q = start_worker(live, tiny_model_dir, "pause-4")
        wait_for(lambda: not r.exists(keys.heartbeat(dead)), 30, "the killed worker's heartbeat to lapse")
        b = submit(prompt_lines(20, rng, max_tokens=8), r=r, model="tiny")
        wait_for(lambda: is_final(r, b.id), 120, "B to finish while A is paused")
        time.sleep(2.0)  # a few more claim rounds of the live worker (every heartbeat_ttl / 2 = 1 s)
        assert (held_by(r, a.id, dead), r.hlen(keys.done(a.id))) == (held, done)  # orphans left alone

        resume_batch(r, a.id)
        wait_for(lambda: is_final(r, a.id), 120, "A to finish once resumed")
        all_completed(r, a.id, n)
        all_completed(r, b.id, 20)
    finally:
        for w in (p, q):
            if w is not None:
                w.kill()
                w.wait()


def test_only_an_open_batch_pauses(live: Live) -> None:
    r = live.r
    a = submit(prompt_lines(2, random.Random(0)), r=r, model="tiny")
    with live.http() as http:
        assert http.post(f"/v1/batches/{a.id}/cancel").status_code == 200
        got = http.post(f"/v1/batches/{a.id}/pause")
        assert got.status_code == 409 and "cancelled" in got.json()["error"]["message"], got.text
        assert http.post("/v1/batches/batch_nope/pause").status_code == 404
        assert http.post("/v1/batches/batch_nope/resume").status_code == 404
    out = run_sluice("pause", a.id)
    assert out.returncode == 1 and "only a validating or in-progress batch" in out.stderr, out.stderr


def test_python_api_pauses_and_resumes(live: Live) -> None:
    import pandas as pd

    import sluice

    batch = sluice.submit(pd.DataFrame({"prompt": ["a", "b", "c"]}), model="nobody-serves-this", r=live.r,
                          max_tokens=2)
    assert batch.pause(now=True).paused_at is not None
    assert live.r.zscore(keys.ready_streams("nobody-serves-this"), keys.jobs(batch.id, 0)) is None
    resumed = batch.resume()
    assert resumed.paused_at is None and resumed.status == "in_progress"
    assert live.r.zscore(keys.ready_streams("nobody-serves-this"), keys.jobs(batch.id, 0)) is not None
    batch.cancel()
