"""The queue path alone (bench/queue_throughput.py --queue-jobs, --spill-jobs): jobs pulled and written back
through the worker's own writer with fake instant outputs, no engine; one node or a cluster."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class Server:
    """A fresh job server for one measurement: the embedded Valkey, or a 3-primary cluster."""

    def __init__(self, cluster: bool) -> None:
        from sluice.jobs.connection import connect, ensure_server
        from sluice.jobs.local_cluster import LocalCluster

        self.dir = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
        self.cluster = LocalCluster(self.dir / "cluster").start() if cluster else None
        self.url = self.cluster.url if self.cluster else ensure_server(self.dir).url
        self.r = connect(self.url)

    def used_memory(self) -> int:
        if self.cluster is not None:
            return self.cluster.used_memory()
        return int(self.r.info("memory")["used_memory"])

    def close(self) -> None:
        from sluice.jobs.connection import stop_server

        self.r.close()
        if self.cluster is not None:
            self.cluster.stop()
        else:
            stop_server(self.dir)


def fake_outcome(d: Any, rng: Any) -> Any:
    """What a worker writes for a completed job, with a made-up output of 100-300 characters."""
    from sluice.jobs.consumer.commands import Outcome
    from sluice.jobs.schemas import Result, ResultUsage

    text = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(100, 300)))
    res = Result(job_id=f"{d.job.batch_id}:{d.job.idx}", custom_id=d.job.custom_id, batch_id=d.job.batch_id,
                 idx=d.job.idx, status="completed", text=text, finish_reason="length", worker="fake",
                 usage=ResultUsage(prompt_tokens=1, completion_tokens=1))
    return Outcome(d.job.batch_id, d.job.idx, "completed", res.model_dump_json(exclude_none=True), d.stream,
                   d.entry_id)


def drain(r: Any, queue: str, writer: Any, rng: Any, pull: int = 2000, after_flush: Any = None,
          spill: Any = None) -> int:
    """A fake worker: pull jobs, 'generate' at once, write each outcome through the worker's writer, and
    move results to files after each flush as the worker's upkeep thread does (``spill``: a Spill).
    A disk that refuses is noted, as the worker notes it; its results stay in Redis."""
    from sluice.jobs.consumer import commands as consumer
    from sluice.jobs.scripts import Scripts

    scripts, done = Scripts(r), 0
    while True:
        got = consumer.read(r, queue, "fake", pull, consumer.ready(r, queue))
        if not got.deliveries:
            return done
        for d in got.deliveries:
            writer.add(fake_outcome(d, rng))
        written = writer.flush(r, scripts, time.time())
        done += len(written)
        if spill is not None:
            try:
                spill.after_write(r, scripts, {w.outcome.batch_id for w in written if w.fresh})
            except OSError as e:
                print(f"spill refused: {e}", file=sys.stderr)
        if after_flush is not None:
            after_flush()


def simple_lines(n: int) -> list[str]:
    return [json.dumps({"custom_id": f"job-{i}", "prompt": f"prompt {i}", "max_tokens": 1}) for i in range(n)]


def key_bytes(r: Any, batch_id: str) -> dict[str, int]:
    """MEMORY USAGE of each key of a batch (SAMPLES 0: every element counted)."""
    from sluice.jobs import keys
    from sluice.jobs.store import priorities

    out = {}
    for k in keys.batch_keys(batch_id, priorities(r, batch_id)):
        used = r.memory_usage(k, samples=0)
        if used:
            out[k.rpartition("}:")[2]] = int(used)
    return out


def bench_queue_path(n: int, cluster: bool, seed: int = 0) -> dict[str, Any]:
    import random

    from sluice.jobs.consumer.outbox import Writer
    from sluice.jobs.store import read_results
    from sluice.jobs.submit import submit

    srv = Server(cluster)
    try:
        base = srv.used_memory()
        t = time.perf_counter()
        batch = submit(simple_lines(n), r=srv.r, model="bench-path")
        submit_s = time.perf_counter() - t
        queued = srv.used_memory()
        queued_keys = key_bytes(srv.r, batch.id)
        t = time.perf_counter()
        assert drain(srv.r, "bench-path", Writer(), random.Random(seed)) == n
        drain_s = time.perf_counter() - t
        stored = srv.used_memory()
        stored_keys = key_bytes(srv.r, batch.id)
        t, cursor, read = time.perf_counter(), "0", 0
        while page := read_results(srv.r, batch.id, cursor, 1000).results:
            read, cursor = read + len(page), read_results(srv.r, batch.id, cursor, 1000).cursor
        read_s = time.perf_counter() - t
        assert read == n, read
        return {"topology": "3-primary cluster" if cluster else "one node", "jobs": n,
                "submit_jobs_per_s": n / submit_s, "drain_jobs_per_s": n / drain_s, "read_results_per_s": n / read_s,
                "bytes_per_queued_job": (queued - base) / n, "bytes_per_stored_result": (stored - base) / n,
                "key_bytes_per_job_queued": {k: v / n for k, v in queued_keys.items()},
                "key_bytes_per_job_stored": {k: v / n for k, v in stored_keys.items()}}
    finally:
        srv.close()


def bench_spill(n: int, spill_at: int, cluster: bool, seed: int = 0) -> dict[str, Any]:
    """One n-job batch, results spilled to files as they land: peak stream length, Redis memory, and
    every result read back exactly once."""
    import random

    from sluice.jobs import keys
    from sluice.jobs.consumer.outbox import CHUNK, Writer
    from sluice.jobs.spill import KEEP, Spill
    from sluice.jobs.store import read_results
    from sluice.jobs.submit import submit

    srv = Server(cluster)
    files = srv.dir / "files"
    os.environ["SLUICE_FILES_DIR"] = str(files)  # where the readers look
    try:
        base = srv.used_memory()
        batch = submit(simple_lines(n), r=srv.r, model="bench-spill")
        queued = srv.used_memory()
        peak = {"stream": 0, "memory": queued}

        def sample() -> None:
            peak["stream"] = max(peak["stream"], srv.r.xlen(keys.results(batch.id)))
            peak["memory"] = max(peak["memory"], srv.used_memory())

        t = time.perf_counter()
        assert drain(srv.r, "bench-spill", Writer(), random.Random(seed), after_flush=sample,
                     spill=Spill(files, spill_at)) == n
        drain_s = time.perf_counter() - t
        stored = srv.used_memory()
        t, cursor, seen = time.perf_counter(), "0", set()
        while page := read_results(srv.r, batch.id, cursor, 1000):
            if not page.results:
                break
            for res in page.results:
                assert res.idx not in seen, f"result {res.idx} read twice"
                seen.add(res.idx)
            cursor = page.cursor
        read_s = time.perf_counter() - t
        assert seen == set(range(n)), f"{n - len(seen)} results missing"
        bound = spill_at + KEEP + 2 * CHUNK  # the stream may grow by a write chunk before a spill trims it
        assert peak["stream"] <= bound, (peak["stream"], bound)
        return {"topology": "3-primary cluster" if cluster else "one node", "jobs": n, "spill_at": spill_at,
                "drain_jobs_per_s": n / drain_s, "read_results_per_s": n / read_s,
                "peak_results_in_redis": peak["stream"], "results_in_redis_bound": bound,
                "bytes_per_queued_job": (queued - base) / n, "bytes_per_job_after_spill": (stored - base) / n,
                "peak_memory_over_base": peak["memory"] - base, "memory_over_base_at_end": stored - base,
                "spilled_bytes_on_disk": sum(p.stat().st_size for p in files.rglob("*.jsonl")),
                "every_result_read_once": True}
    finally:
        srv.close()
