"""Helpers of the job-plane tests: waiting, checking exactly-once outcomes, workers in threads or
subprocesses, tiny engines (the fixtures are in jobs_fixtures.py)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from sluice.jobs import keys
from sluice.jobs.schemas import Result
from sluice.jobs.store import pending_under

ROOT = Path(__file__).resolve().parents[2]


def wait_for(cond: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def prompt_lines(n: int, rng: Any, max_tokens: int = 4, **extra: Any) -> list[str]:
    """Simple lines with random short prompts; every job generates exactly ``max_tokens`` tokens."""
    words = ["sluice", "river", "gate", "water", "stone", "mill", "wheel", "bank", "flow", "lock"]
    return [json.dumps({"custom_id": f"job-{i}", "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(2, 9))),
                        "max_tokens": max_tokens, "ignore_eos": True, **extra}) for i in range(n)]


FEW_SHOT_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho".split()


def few_shot_lines(rng: random.Random, k: int, per: int, shots: int) -> tuple[list[str], list[str]]:
    """``k`` few-shot prefixes (a system turn and ``shots`` worked examples), ``per`` questions behind each,
    shuffled; returns the lines and each line's prefix name."""
    prefixes = []
    for g in range(k):
        shots_text = [{"role": r, "content": " ".join(rng.choice(FEW_SHOT_WORDS) for _ in range(12))}
                      for _ in range(shots) for r in ("user", "assistant")]
        prefixes.append([{"role": "system", "content": f"task {g}"}, *shots_text])
    jobs = [(g, i) for g in range(k) for i in range(per)]
    rng.shuffle(jobs)
    lines, groups = [], []
    for n, (g, _) in enumerate(jobs):
        question = " ".join(rng.choice(FEW_SHOT_WORDS) for _ in range(rng.randint(2, 8)))
        lines.append(json.dumps({"custom_id": f"q{n}", "messages": [*prefixes[g], {"role": "user", "content": question}],
                                 "max_tokens": 3}))
        groups.append(f"g{g}")
    return lines, groups


def result_entries(r: redis.Redis, batch_id: str) -> list[dict[str, Any]]:
    """The results stream, in order, each entry read as a full Result."""
    return [Result.model_validate_json(f["r"]).model_dump() for _, f in r.xrange(keys.results(batch_id))]


def held_by(r: redis.Redis, batch_id: str, consumer: str) -> int:
    """Pending entries of ``consumer`` over the batch's job streams: what Redis says it holds."""
    return pending_under(r, batch_id, consumer)


def assert_exactly_once(r: redis.Redis, batch_id: str, total: int) -> list[dict[str, Any]]:
    """Every job has one outcome in the results stream, and the counters agree."""
    entries = result_entries(r, batch_id)
    idxs = [e["idx"] for e in entries]
    assert sorted(idxs) == list(range(total)), f"duplicates or gaps: {len(idxs)} entries for {total} jobs"
    meta = r.hgetall(keys.meta(batch_id))
    by_status: dict[str, int] = {}
    for e in entries:
        by_status[e["status"]] = by_status.get(e["status"], 0) + 1
    for s in ("completed", "failed", "cancelled", "expired"):
        assert int(meta[s]) == by_status.get(s, 0), f"counter {s}={meta[s]} but {by_status.get(s, 0)} results"
    assert int(meta["total"]) == total
    return entries


class ThreadWorker:
    """A Worker running in a thread of the test process."""

    def __init__(self, llm: Any, **opts: Any) -> None:
        from sluice.worker.worker import Worker, WorkerOptions

        opts.setdefault("queue", "tiny")
        opts.setdefault("heartbeat_ttl", 2.0)
        opts.setdefault("poll_interval", 0.02)
        self.stop = threading.Event()
        self.worker = Worker(llm, WorkerOptions(**opts), self.stop)
        self.error: BaseException | None = None
        self.report: Any = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.report = self.worker.run()
        except BaseException as e:  # noqa: BLE001 - surfaced by join()
            self.error = e

    def join(self, timeout: float = 60.0) -> Any:
        self.stop.set()
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not stop"
        if self.error is not None:
            raise self.error
        return self.report


def worker_process(model_dir: Path, worker_id: str, *args: str, log: Path | None = None,
                   paced: bool = False) -> subprocess.Popen:
    """``python -m sluice.worker`` on the tiny model, in the test's SLUICE_HOME (from the environment). ``paced``:
    every engine step takes at least tests/support/paced.py's PACE, so the batch is still running when the test
    acts on the worker, on any machine."""
    entry = [str(ROOT / "tests" / "support" / "paced.py"), "sluice.worker"] if paced else ["-m", "sluice.worker"]
    cmd = [sys.executable, *entry, "--model", str(model_dir), "--queue", "tiny", "--dtype", "float32",
           "--worker-id", worker_id, "--heartbeat-ttl", "2", *args]
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=out, stderr=subprocess.STDOUT)


def kill_9_mid_batch(r: redis.Redis, batch_id: str, total: int, fracs: tuple[float, ...],
                     start: Callable[[], subprocess.Popen], log: Path, worker_id: str, timeout: float) -> None:
    """A worker from ``start()`` killed (-9) once each fraction of the batch is done, each time holding jobs."""
    for frac in fracs:
        p = start()
        try:
            wait_for(lambda p=p, frac=frac: r.hlen(keys.done(batch_id)) >= frac * total or p.poll() is not None,
                     timeout, f"{frac:.0%} done")
            assert p.poll() is None, log.read_text()[-3000:]
            assert held_by(r, batch_id, worker_id) > 0  # it dies holding jobs
        finally:
            p.kill()
            p.wait()


def finish_with(r: redis.Redis, batch_id: str, p: subprocess.Popen, log: Path, timeout: float) -> None:
    """Worker ``p`` (started with --exit-when-idle) finishes the batch, then exits cleanly."""
    from sluice.jobs.store import get_batch

    try:
        wait_for(lambda: get_batch(r, batch_id).is_final, timeout, "the batch to finish")
        assert p.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        p.kill()
