"""The job plane on a real 3-primary Valkey Cluster (``redis+cluster://``): submission spreads batches
over the nodes, two workers share them, a kill -9'd worker's jobs are reclaimed, cancel, results
paging, the OpenAI SDK flow, and a primary restarted mid-batch. Each test checks exactly one outcome
per job, as tests/worker/test_worker.py does on one server."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
from fastapi.testclient import TestClient
from held_engine import HeldLLM
from helpers import fresh_seed
from jobs_helpers import (
    ThreadWorker,
    assert_exactly_once,
    held_by,
    prompt_lines,
    result_entries,
    wait_for,
    worker_process,
)
from paced import PacedLLM
from sluice.api.app import create_app
from sluice.api.settings import Settings
from sluice.engine.llm import LLM
from sluice.jobs import keys
from sluice.jobs.local_cluster import LocalCluster
from sluice.jobs.store import cancel_batch, get_batch, list_workers, read_results
from sluice.jobs.submit import submit

pytest_plugins = ["cluster_fixtures"]
pytestmark = pytest.mark.cluster


def engine(model_dir: Path, max_num_seqs: int = 8, cls: type = LLM) -> Any:
    return cls(str(model_dir), dtype="float32", max_num_seqs=max_num_seqs, kv_cache_memory=4 << 20)


def final(r: redis.Redis, batch_id: str) -> bool:
    b = get_batch(r, batch_id)
    return b is not None and b.is_final


def test_batches_spread_over_the_nodes_two_workers_share_them(cr: redis.Redis, cluster: LocalCluster,
                                                               tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    batches = [submit(prompt_lines(4, rng, max_tokens=2), r=cr, model="tiny") for _ in range(24)]
    for b in batches:  # every key of a batch in one slot: its scripts never cross slots
        slots = {cr.keyslot(k) for k in keys.batch_keys(b.id, [0])}
        assert len(slots) == 1, (b.id, slots)
    nodes = Counter(cluster.node_of(keys.meta(b.id)) for b in batches)
    assert set(nodes) == {0, 1, 2}, f"24 batches did not reach every node: {nodes}"
    llms = [engine(tiny_model_dir) for _ in range(2)]  # both built before either starts: neither has a head start
    workers = [ThreadWorker(llm, worker_id=f"w{i}") for i, llm in enumerate(llms)]
    try:
        wait_for(lambda: {w.id for w in list_workers(cr)} >= {"w0", "w1"}, 30, "both heartbeats")
        wait_for(lambda: all(final(cr, b.id) for b in batches), 120, "every batch to finish")
    finally:
        reports = [w.join() for w in workers]
    share: Counter[str] = Counter()
    for b in batches:
        assert get_batch(cr, b.id).status == "completed"
        share.update(e["worker"] for e in assert_exactly_once(cr, b.id, 4))
    assert min(share["w0"], share["w1"]) >= 0.2 * 96, share
    assert sum(rep.completed for rep in reports) == 96
    assert cr.zrange(keys.active_streams("tiny"), 0, -1) == [] and cr.zcard(keys.open_batches()) == 0


def test_kill_9_worker_then_another_reclaims(cr: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 60
    b = submit(prompt_lines(n, rng, max_tokens=10), r=cr, model="tiny")
    log = tmp_path / "worker.log"
    p = worker_process(tiny_model_dir, "w1", "--max-num-seqs", "12", "--kv-cache-memory", str(4 << 20), log=log,
                       paced=True)  # still holding jobs when killed, however fast the machine
    try:
        wait_for(lambda: cr.hlen(keys.done(b.id)) >= 10 or p.poll() is not None, 120, "10 results")
        assert p.poll() is None, log.read_text()[-3000:]
        assert held_by(cr, b.id, "w1") > 0  # it dies holding jobs
    finally:
        p.kill()
        p.wait()
    w = ThreadWorker(engine(tiny_model_dir, 12), worker_id="w2")
    try:
        wait_for(lambda: final(cr, b.id), 120, "the batch to finish")
    finally:
        report = w.join()
    assert report.claimed > 0 and held_by(cr, b.id, "w1") == 0
    entries = assert_exactly_once(cr, b.id, n)
    assert all(e["status"] == "completed" for e in entries)


def test_cancel_and_results_paging(cr: redis.Redis, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 80
    b = submit(prompt_lines(n, rng, max_tokens=24), r=cr, model="tiny")
    w = ThreadWorker(engine(tiny_model_dir, 4, PacedLLM))  # 500 steps, 10 s at the least: cancelled part-way
    try:
        wait_for(lambda: cr.hlen(keys.done(b.id)) >= 8, 120, "8 results")
        assert cancel_batch(cr, b.id) is not None
        wait_for(lambda: final(cr, b.id), 60, "the cancel to settle")
    finally:
        w.join()
    batch = get_batch(cr, b.id)
    assert batch.status == "cancelled" and batch.counts.cancelled > 0 and batch.counts.completed >= 8
    entries = assert_exactly_once(cr, b.id, n)
    pages, cursor, seen = 0, "0", []
    while page := read_results(cr, b.id, cursor, limit=7).results:
        seen += [res.idx for res in page]
        cursor, pages = read_results(cr, b.id, cursor, limit=7).cursor, pages + 1
    assert seen == [e["idx"] for e in entries] and pages == -(-n // 7)


def test_openai_sdk_flow(cr: redis.Redis, cluster: LocalCluster, tiny_model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    n = rng.randint(6, 12)
    lines = [json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "tiny", "max_tokens": 3,
                                  "messages": [{"role": "user", "content": f"river {rng.random()}"}]}})
             for i in range(n)]
    settings = Settings(redis_url=cluster.url, files_dir=tmp_path / "files", api_key="k")
    w = ThreadWorker(engine(tiny_model_dir))
    try:
        with TestClient(create_app(settings)) as http:
            client = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)
            f = client.files.create(file=("in.jsonl", "\n".join(lines).encode()), purpose="batch")
            batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            batch = wait_for(lambda: (x := client.batches.retrieve(batch.id)).status == "completed" and x, 120,
                             "the batch to complete")
            out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    finally:
        w.join()
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
    assert all(x["response"]["status_code"] == 200 for x in out)
    assert_exactly_once(cr, batch.id, n)


def test_primary_restarted_mid_batch_loses_nothing_acknowledged(cr: redis.Redis, cluster: LocalCluster,
                                                                tiny_model_dir: Path) -> None:
    """kill -9 of the primary holding a batch, then a restart from its AOF: the results it had
    acknowledged are all there, the worker held what it could not write, and every job ends once."""
    rng = random.Random(fresh_seed())
    n = 60
    b = submit(prompt_lines(n, rng, max_tokens=8), r=cr, model="tiny")
    node = cluster.node_of(keys.meta(b.id))
    llm = engine(tiny_model_dir, 6, HeldLLM)
    llm.hold_when(lambda: llm.completed >= 12)  # the node dies with 48 jobs to run, however fast the machine
    w = ThreadWorker(llm)
    try:
        wait_for(lambda: llm.is_held and cr.hlen(keys.done(b.id)) >= 12, 120, "12 results")
        acknowledged = {e["idx"]: e for e in result_entries(cr, b.id)}
        cluster.kill_node(node)
        llm.release()
        wait_for(lambda: len(w.worker.session.outbox) > 0, 30, "results held while the node is down")
        cluster.start_node(node)
        wait_for(lambda: final(cr, b.id), 120, "the batch to finish")
    finally:
        llm.release()
        w.join()
    after = {e["idx"]: e for e in result_entries(cr, b.id)}
    assert all(after[i] == e for i, e in acknowledged.items()), "an acknowledged result was lost"
    assert_exactly_once(cr, b.id, n)
    assert get_batch(cr, b.id).counts.completed == n


def test_the_cluster_switch_and_the_spill_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.jobs.connection import is_cluster_url
    from sluice.jobs.settings import JobPlaneSettings, SettingsError, job_plane, load

    monkeypatch.setenv("SLUICE_REDIS_URL", "redis+cluster://:pw@10.0.0.5:6379")
    assert is_cluster_url(job_plane().redis_url or "")
    monkeypatch.setenv("SLUICE_REDIS_URL", "http://10.0.0.5:6379")
    with pytest.raises(SettingsError, match="SLUICE_REDIS_URL: .*redis\\+cluster://"):
        job_plane()
    monkeypatch.delenv("SLUICE_REDIS_URL")
    monkeypatch.setenv("SLUICE_RESULTS_SPILL", "-1")
    with pytest.raises(SettingsError, match="SLUICE_RESULTS_SPILL"):
        load(JobPlaneSettings)
