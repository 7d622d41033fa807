"""Results spilled out of Redis to files (jobs/spill.py) as they land, through the real writer path
(jobs/consumer/outbox.py, the RECORD script) with fake fast outputs: `sluice results --follow`, the API's
results pages and ``read_results`` return every line exactly once across the files/stream boundary,
and Redis memory stays bounded. The 200,000-job run is ``bench/queue_throughput.py --spill-jobs``."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import types
from pathlib import Path

import pytest
import redis
from cli_api_helpers import start_sluice
from fastapi.testclient import TestClient
from helpers import fresh_seed
from jobs_helpers import ROOT
from sluice.api.app import create_app
from sluice.api.settings import Settings
from sluice.jobs import keys, spill
from sluice.jobs.consumer.outbox import CHUNK, Writer
from sluice.jobs.local_cluster import LocalCluster
from sluice.jobs.scripts import Scripts, note_spilled
from sluice.jobs.spill import Spill
from sluice.jobs.store import delete_batch, get_batch, get_result, read_results
from sluice.jobs.submit import submit

pytest_plugins = ["jobs_fixtures", "cluster_fixtures"]


def lines(n: int) -> list[str]:
    return [json.dumps({"custom_id": f"job-{i}", "prompt": "x", "max_tokens": 1}) for i in range(n)]


# The fake worker (pull, 'generate' at once, write through jobs/consumer/outbox.py) is the benchmark's.
_spec = importlib.util.spec_from_file_location("bench_queue_path", ROOT / "bench" / "queue_path.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)
drain = bench.drain


def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


def test_spilled_results_come_back_once_each_across_the_boundary(r: redis.Redis, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    n, at = 20_000, 1000
    files = tmp_path / "files"
    monkeypatch.setenv("SLUICE_FILES_DIR", str(files))
    base = used_memory(r)
    b = submit(lines(n), r=r, model="spill")
    out = tmp_path / "out.jsonl"
    log = tmp_path / "follow.log"
    follow = start_sluice("results", b.id, "--follow", "-o", str(out), "--no-progress", log=log)
    api = TestClient(create_app(Settings(api_key=None)))
    pages: list[str] = []
    cursor = "0"

    def read_a_page() -> None:  # a progressive download while results land and spill
        nonlocal cursor
        page = api.get(f"/v1/batches/{b.id}/results", params={"after": cursor, "limit": 700})
        assert page.status_code == 200, page.text
        pages.extend(json.loads(x)["custom_id"] for x in page.text.splitlines())
        cursor = page.headers["Sluice-Cursor"]

    peak = 0

    def after_flush() -> None:
        nonlocal peak
        peak = max(peak, r.xlen(keys.results(b.id)))
        read_a_page()

    assert drain(r, "spill", Writer(), rng, after_flush=after_flush, spill=Spill(files, at)) == n
    assert get_batch(r, b.id).status == "completed"
    end = used_memory(r)
    while True:
        before = len(pages)
        read_a_page()
        if len(pages) == before:
            break
    assert follow.wait(timeout=120) == 0, log.read_text()
    want = sorted(f"job-{i}" for i in range(n))

    # Every line exactly once: the CLI following, the API paging, read_results from the start.
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == want
    assert sorted(pages) == want
    everything = read_results(r, b.id, "0", n + 1).results
    assert sorted(x.custom_id for x in everything) == want
    # Most of it in files, the stream kept short while it ran.
    spilled = sum(1 for p in spill.batch_dir(files, b.id).glob("*.jsonl") for _ in p.open())
    assert spilled >= n - at - spill.KEEP - CHUNK and r.xlen(keys.results(b.id)) == n - spilled
    assert peak <= at + spill.KEEP + 2 * CHUNK, peak
    early = get_result(r, b.id, "job-0")
    assert early is not None and early.idx == 0 and early.text  # found in a file
    # Redis memory: what stays per job once its result is in a file (the exactly-once index and the
    # custom_id maps), plus the unspilled tail; without spilling it is ~10x this (bench numbers, docs/deployment.md).
    per_job = (end - base) / n
    print(f"seed={seed} Redis memory after {n} results: {end - base} bytes ({per_job:.0f} per job)")
    assert end - base <= n * 250 + (at + spill.KEEP + CHUNK) * 1000, (end - base, per_job)
    # A reader that does not see the directory says so, instead of returning a page with a hole.
    monkeypatch.setenv("SLUICE_FILES_DIR", str(tmp_path / "elsewhere"))
    miss = api.get(f"/v1/batches/{b.id}/results")
    assert miss.status_code == 500 and miss.json()["error"]["code"] == "results_not_readable", miss.text
    assert "SLUICE_FILES_DIR" in miss.json()["error"]["message"]
    monkeypatch.setenv("SLUICE_FILES_DIR", str(files))
    delete_batch(r, b.id)
    assert not spill.batch_dir(files, b.id).exists()


@pytest.mark.cluster
def test_spill_on_a_cluster(cr: redis.Redis, cluster: LocalCluster, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(fresh_seed())
    files = tmp_path / "files"
    monkeypatch.setenv("SLUICE_FILES_DIR", str(files))
    batches = [submit(lines(1500), r=cr, model="spill") for _ in range(3)]
    assert drain(cr, "spill", Writer(), rng, spill=Spill(files, 300)) == 4500
    for b in batches:
        assert get_batch(cr, b.id).status == "completed"
        assert cr.llen(keys.spill_chunks(b.id)) >= 1
        seen, cursor = [], "0"
        while page := read_results(cr, b.id, cursor, 333):
            if not page.results:
                break
            seen += [x.idx for x in page.results]
            cursor = page.cursor
        assert sorted(seen) == list(range(1500))


def test_a_spiller_that_died_or_lost_the_race_changes_nothing(r: redis.Redis, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk file written but never noted (its spiller died before the script) and a spiller whose
    chunk number was taken meanwhile (the script refuses it): readers see each result once."""
    rng = random.Random(fresh_seed())
    files = tmp_path / "files"
    monkeypatch.setenv("SLUICE_FILES_DIR", str(files))
    b = submit(lines(3000), r=r, model="race")
    assert drain(r, "race", Writer(), rng) == 3000  # SLUICE_RESULTS_SPILL unset: nothing moves
    assert r.xlen(keys.results(b.id)) == 3000 and not r.exists(keys.spill_chunks(b.id))
    entries = r.xrange(keys.results(b.id), "-", "+", count=500)
    dead = spill.chunk_path(files, b.id, 0, entries[-1][0])
    spill._write(dead, entries, "dead")  # the spiller died here, before noting the chunk
    scripts = Scripts(r)
    assert spill.spill(r, scripts, files, b.id, keep=100) == 2900
    ends = r.lrange(keys.spill_chunks(b.id), 0, -1)
    assert len(ends) == 1 and ends[0] != entries[-1][0] and r.xlen(keys.results(b.id)) == 100
    # A late spiller that read chunk count 0 before: refused, the stream untouched.
    assert note_spilled(scripts, b.id, 0, ends[0], "9999999999999-0") == 0
    assert r.xlen(keys.results(b.id)) == 100 and dead.exists()  # the orphan is ignored by readers
    whole = [x.idx for x in read_results(r, b.id, "0", 10_000).results]
    assert sorted(whole) == list(range(3000))
    # From a cursor in the middle of the chunk, and from the last spilled id (the boundary itself).
    page = read_results(r, b.id, "0", 1234)
    rest = read_results(r, b.id, page.cursor, 10_000).results
    assert [x.idx for x in page.results] + [x.idx for x in rest] == whole
    assert [x.idx for x in read_results(r, b.id, ends[0], 10_000).results] == whole[2900:]


def test_a_full_disk_leaves_nothing_behind_and_spills_once_it_has_room(r: redis.Redis, small_disk: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills: every result stays readable in Redis, no half-written chunk is left, no retry
    rewrites the chunk before its backoff, and the batch, finished meanwhile, is spilled once the disk
    has room, without another result of it ever arriving."""
    rng = random.Random(fresh_seed())
    monkeypatch.setenv("SLUICE_FILES_DIR", str(small_disk))
    # The spill's clock stands still until the test moves it: a backoff is waited out by the test's
    # word, not by however long the drain took on this machine.
    clock = types.SimpleNamespace(monotonic=lambda: 1000.0)
    monkeypatch.setattr(spill, "time", clock)
    filler = small_disk / "filler"
    with open(filler, "wb") as f:
        with contextlib.suppress(OSError):
            f.write(b"\0" * (8 << 20))  # stops at ENOSPC
    n, at = 3000, 500
    b = submit(lines(n), r=r, model="full")
    sp = Spill(small_disk, at)
    assert drain(r, "full", Writer(), rng, spill=sp) == n
    assert get_batch(r, b.id).status == "completed" and r.xlen(keys.results(b.id)) == n
    assert [p.name for p in small_disk.rglob("*") if p.is_file()] == ["filler"]  # no temp file left
    assert sp.owed == {b.id} and sp.backoff == 1.0
    assert sp.spill_owed(r, Scripts(r)) == 0 and sp.backoff == 1.0  # waits out its backoff: no write tried
    filler.unlink()
    sp.retry_at = 0.0  # the backoff has passed
    moved = 0
    while sp.owed:
        moved += sp.spill_owed(r, Scripts(r))
    assert moved == n - spill.KEEP and r.xlen(keys.results(b.id)) == spill.KEEP and sp.backoff == 0.0
    assert sorted(x.idx for x in read_results(r, b.id, "0", n + 1).results) == list(range(n))
