"""A sick engine under the job plane: one that fails every step hands its jobs back and exits; a request that
breaks the engine for good is charged once proven alone (issue 21, item 2). Against the real embedded Valkey."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import fresh_seed
from jobs_helpers import ROOT, ThreadWorker, assert_exactly_once, prompt_lines, wait_for
from reliability_helpers import final, pending, run_to_end, tiny
from sluice.engine.llm import LLM
from sluice.jobs import keys
from sluice.jobs.store import dead_letters, get_batch, queue_depth
from sluice.jobs.submit import submit

pytest_plugins = ["jobs_fixtures"]


# ---- 4. a sick engine must not dead-letter the queue -------------------------------------------------
class SickLLM(LLM):
    """Every step fails, whatever it runs."""

    def step(self) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_sick_engine_hands_its_jobs_back_and_exits(r: redis.Redis, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 40
    b = submit(prompt_lines(n, rng, max_tokens=4), r=r, model="tiny")
    sick = ThreadWorker(tiny(tiny_model_dir, SickLLM, max_num_seqs=8))
    wait_for(lambda: not sick.thread.is_alive(), 30, "the sick worker to exit by itself")
    assert sick.error is not None and "probe" in str(sick.error)
    assert dead_letters(r, b.id) == [] and r.hlen(keys.done(b.id)) == 0
    assert pending(r, b.id) == 0 and queue_depth(r, "tiny") == n
    run_to_end(r, b.id, tiny(tiny_model_dir))  # a healthy worker
    entries = assert_exactly_once(r, b.id, n)
    assert all(e["status"] == "completed" for e in entries)


def test_the_worker_process_exits_non_zero_when_the_engine_is_sick(monkeypatch: pytest.MonkeyPatch) -> None:
    import sluice.worker.__main__ as main
    from sluice.worker.isolation import EngineSick

    def sick(*a: Any, **kw: Any) -> Any:
        raise EngineSick("the engine fails a probe request on its own")

    monkeypatch.setattr(main, "run_worker", sick)
    with pytest.raises(SystemExit) as exc:
        main.main(["--model", "x"])
    assert exc.value.code == main.EXIT_ENGINE_SICK != 0


# ---- a request that breaks the engine for good is charged once proven alone (issue 21, item 2) -------
BREAKER = "BREAKS-THE-ENGINE"


class Supervised:
    """Worker processes of bench/faults.py (a request with BREAKER in its prompt breaks the engine for
    good, as a CUDA device-side assert does), each restarted when it exits "engine sick", as a
    supervisor (compose, systemd) would."""

    def __init__(self, model_dir: Path, ids: list[str], args: list[str], logs: Path, max_restarts: int) -> None:
        self.model_dir, self.args, self.logs, self.max_restarts = model_dir, args, logs, max_restarts
        self.log_at_start: dict[str, int] = {}
        self.procs = {wid: self._start(wid) for wid in ids}
        self.sick_exits = 0

    def _start(self, wid: str) -> subprocess.Popen:
        cmd = [sys.executable, str(ROOT / "bench" / "faults.py"), "--model", str(self.model_dir), "--queue", "tiny",
               "--dtype", "float32", "--worker-id", wid, *self.args]
        log = self.logs / f"{wid}.log"
        self.log_at_start[wid] = log.stat().st_size if log.exists() else 0
        out = open(log, "ab")  # noqa: SIM115 - the child owns it
        return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "CHAOS_BREAK_ON": BREAKER}, stdout=out,
                                stderr=subprocess.STDOUT)

    def tail(self) -> str:
        return "".join(f"---- {wid}\n{(self.logs / f'{wid}.log').read_text()[-2000:]}" for wid in self.procs)

    def up(self, wid: str) -> bool:
        """The latest start of ``wid`` runs its loop (its SIGTERM handler is in place) and is not on its way
        out sick (a SIGTERM then would meet a worker already exiting 3: seen once, at a load of ~6)."""
        with open(self.logs / f"{wid}.log", "rb") as f:
            f.seek(self.log_at_start[wid])
            text = f.read().decode(errors="replace")
        return f"worker {wid} on queue" in text and "engine sick" not in text

    def revive(self) -> None:
        """Restart the workers that exited sick; any other exit is a failure."""
        from sluice.worker.__main__ import EXIT_ENGINE_SICK

        for wid, p in self.procs.items():
            code = p.poll()
            if code is None:
                continue
            assert code == EXIT_ENGINE_SICK, f"{wid} exited {code}: {self.tail()}"
            self.sick_exits += 1
            assert self.sick_exits <= self.max_restarts, f"still not settled after {self.sick_exits} sick exits"
            self.procs[wid] = self._start(wid)

    def stop(self) -> list[int]:
        """Once each is up (restarted if it exited sick), SIGTERM: each drains and exits 0."""
        wait_for(lambda: self.revive() or all(self.up(w) for w in self.procs), 120, "every worker up", every=0.2)
        for p in self.procs.values():
            p.terminate()
        return [p.wait(timeout=60) for p in self.procs.values()]

    def kill(self) -> None:
        for p in self.procs.values():
            p.kill()
            p.wait()


def test_only_a_job_that_breaks_a_working_engine_alone_is_the_culprit() -> None:
    """worker/isolation.py's rules, when the probe after a failure fails too (the engine is broken)."""
    from sluice.worker.isolation import Isolation

    boom = RuntimeError("device-side assert")
    iso: Isolation[str] = Isolation()
    iso.step_failed(["a", "poison"])  # a shared step broke the engine: the first job alone fails on it too
    assert iso.next_alone() == "a"
    iso.failed_alone("a", boom)
    assert iso.next_probe() is not None and iso.culprit() is None  # "a" is not to blame
    fresh: Isolation[str] = Isolation()  # the next worker, holding the jobs of that sick episode
    fresh.wary.extend(["a", "poison"])
    assert fresh.next_alone() is None  # a fresh engine is not known to work: the probe first
    assert fresh.next_probe() is not None and fresh.next_alone() is None
    assert fresh.probe_passed() is None
    assert fresh.next_alone() == "a"
    fresh.discard("a")  # completed
    fresh.step_ok()
    assert fresh.next_probe() is None and fresh.next_alone() == "poison"
    fresh.failed_alone("poison", boom)
    culprit = fresh.culprit()
    assert fresh.next_probe() is not None and culprit is not None and culprit.held == "poison"


def test_a_request_that_breaks_the_engine_ends_failed_and_the_rest_complete(r: redis.Redis, tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """Two worker processes; one job of the batch breaks any engine that runs it. The first worker to
    run it cannot tell which job of its step did (it exits sick, charging none); from then on each job
    it held runs alone, so the poison breaks a working engine alone, is charged each time, and ends
    failed after max_deliveries (3) with the reason; every other job completes exactly once. Before
    this, every worker that took it exited sick uncharged, and the job never settled."""
    rng = random.Random(fresh_seed())
    n = 30
    lines = prompt_lines(n, rng, max_tokens=4)
    at = rng.randrange(n + 1)
    lines.insert(at, json.dumps({"custom_id": "poison", "prompt": f"river {BREAKER} gate", "max_tokens": 4}))
    b = submit(lines, r=r, model="tiny")
    workers = Supervised(tiny_model_dir, ["w1", "w2"], ["--max-num-seqs", "8", "--kv-cache-memory", str(4 << 20),
                                                         "--max-deliveries", "3", "--heartbeat-ttl", "10"],
                         tmp_path, max_restarts=8)
    try:
        wait_for(lambda: workers.revive() or final(r, b.id), 300, "the batch to finish", every=0.2)
        assert workers.stop() == [0, 0], workers.tail()
    finally:
        workers.kill()
    batch = get_batch(r, b.id)
    assert batch.status == "completed" and (batch.counts.completed, batch.counts.failed) == (n, 1)
    entries = {e["custom_id"]: e for e in assert_exactly_once(r, b.id, n + 1)}
    poison = entries.pop("poison")
    assert poison["status"] == "failed" and poison["error"]["code"] == "dead_letter"
    assert "the engine failed while running this request alone" in poison["error"]["message"]
    assert "device-side assert" in poison["error"]["message"]
    assert all(e["status"] == "completed" for e in entries.values())
    dead = dead_letters(r, b.id)
    assert [d["custom_id"] for d in dead] == ["poison"] and dead[0]["deliveries"] >= 3
    # Once unproven in a step with others, then alone on an engine that had just worked, charged each time
    # (three times, unless a worker's heartbeat lapsed on this loaded machine and a claim counted one).
    assert 2 <= workers.sick_exits <= 4, workers.tail()
    assert int(r.hget(keys.sick_episodes(b.id), str(at))) == workers.sick_exits
