"""Chaos run of the job plane: one batch through several worker processes while they are killed,
paused and the job server restarts; then every promise is checked.

    python bench/chaos.py --model /path/to/tiny-model                     # the long setting
    python bench/chaos.py --model DIR --jobs 500 --kills 3 --seed 7       # tests/worker/test_chaos.py's scale

During the batch (``--jobs`` jobs, mixed priorities and lengths, ``--workers`` workers on ``--model``):
kill -9 a worker holding jobs ``--kills`` times and restart it, restart the Valkey server once (AOF
on, kill -9), cancel another batch, stall the results disk (every write of a results chunk hangs)
until a number of further results were written meanwhile, submit a batch holding one request that
breaks the engine of any worker that runs it (as a CUDA device-side assert does; the workers exit
"engine sick" and are restarted, as a supervisor would), and last SIGSTOP a worker holding jobs for
longer than the heartbeat TTL and SIGCONT it. The workers run bench/faults.py, which injects the
disk and engine faults, and move results to files after a few dozen. Each fault lands at a point of
the batch's progress (jobs done), and the workers are frozen while a holder is chosen, so the run
means the same on a fast machine as on a slow one. Afterwards: every job of the batch has exactly one
outcome, the counters equal the results (files and stream), nothing is left pending, nothing was
dead-lettered (no job here fails on its own), the batch is ``completed`` and the cancelled one
``cancelled``; in the poisoned batch only the poison failed, dead-lettered as the request that broke
the engine alone, and every other job completed. Prints the seed, and a JSON summary as its last
line; exits 1 on a broken promise. Uses ``SLUICE_HOME`` (a temporary one if unset).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after site-packages: our kernels/ must not hide transformers' kernels

import redis  # noqa: E402
from sluice.jobs import keys  # noqa: E402
from sluice.jobs.connection import ENV_HOME, connect, ensure_server, stop_server  # noqa: E402
from sluice.jobs.schemas import Result  # noqa: E402
from sluice.jobs.store import cancel_batch, dead_letters, get_batch, pending_under, read_results  # noqa: E402
from sluice.jobs.submit import submit  # noqa: E402
from sluice.worker.__main__ import EXIT_ENGINE_SICK  # noqa: E402

QUEUE = "chaos"
HEARTBEAT_TTL = 2.0
BREAKER = "CHAOS-BREAKS-THE-ENGINE"  # the prompt text that breaks an engine (bench/faults.py)
SPILL_AT, SPILL_KEEP = 8, 16  # results move to files once a batch holds more than 24 in Redis
WORDS = ["sluice", "river", "gate", "water", "stone", "mill", "wheel", "bank", "flow", "lock"]


class Broken(AssertionError):
    pass


def lines(n: int, rng: random.Random, max_tokens: tuple[int, int], prefix: str) -> list[str]:
    return [json.dumps({"custom_id": f"{prefix}{i}", "prompt": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30))),
                        "max_tokens": rng.randint(*max_tokens), "ignore_eos": True, "priority": rng.randint(-3, 3)})
            for i in range(n)]


def poisoned_lines(n: int, rng: random.Random) -> list[str]:
    """``n`` ordinary jobs and, among them, one whose prompt breaks the engine (custom_id "poison")."""
    out = lines(n, rng, (4, 16), "p")
    out.insert(rng.randrange(n + 1), json.dumps({"custom_id": "poison", "prompt": f"water {BREAKER} stone",
                                                 "max_tokens": 8, "ignore_eos": True}))
    return out


def check_poisoned(r: redis.Redis, batch_id: str, total: int) -> dict[str, int]:
    """Only the poison failed, dead-lettered as the request that broke the engine alone."""
    outcomes = check(r, batch_id, total, "completed")
    dead = dead_letters(r, batch_id)
    if outcomes != {"completed": total - 1, "failed": 1} or [d["custom_id"] for d in dead] != ["poison"]:
        raise Broken(f"{batch_id}: outcomes {outcomes}, dead letters {[d['custom_id'] for d in dead]}")
    if "the engine failed while running this request alone" not in dead[0]["error"]:
        raise Broken(f"the poison failed with another error: {dead[0]['error']}")
    return outcomes


class Workers:
    def __init__(self, model: str, n: int, logs: Path, max_num_seqs: int, max_deliveries: int) -> None:
        self.model, self.logs, self.max_num_seqs, self.max_deliveries = model, logs, max_num_seqs, max_deliveries
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.log_at_start: dict[str, int] = {}  # where each worker's latest start begins in its log
        self.slow_disk = logs / "slow-disk"  # while it exists, results chunk writes stall (bench/faults.py)
        self.sick_exits = 0
        for i in range(n):
            self.start(f"w{i}")

    def up(self, wid: str) -> bool:
        """The latest start of ``wid`` runs its loop (its signal handlers are in place). Only what that
        start wrote counts: a start killed before it announced itself never will (counting starts
        against announcements waited forever after a kill -9 that landed during a restart)."""
        with open(self.logs / f"{wid}.log", "rb") as f:
            f.seek(self.log_at_start[wid])
            since = f.read().decode(errors="replace")
        return f"worker {wid} on queue" in since or self.procs[wid].poll() is not None

    def start(self, wid: str) -> None:
        log = self.logs / f"{wid}.log"
        self.log_at_start[wid] = log.stat().st_size if log.exists() else 0
        cmd = [sys.executable, str(ROOT / "bench" / "faults.py"), "--model", self.model, "--queue", QUEUE, "--dtype", "float32",
               "--worker-id", wid, "--heartbeat-ttl", str(HEARTBEAT_TTL), "--max-deliveries", str(self.max_deliveries),
               "--max-num-seqs", str(self.max_num_seqs), "--kv-cache-memory", str(4 << 20)]
        out = open(self.logs / f"{wid}.log", "ab")  # noqa: SIM115 - the child owns it
        env = {**os.environ, "CHAOS_BREAK_ON": BREAKER, "CHAOS_SLOW_DISK": str(self.slow_disk),
               "CHAOS_SPILL_KEEP": str(SPILL_KEEP), "SLUICE_RESULTS_SPILL": str(SPILL_AT)}
        self.procs[wid] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def revive(self) -> None:
        """Restart the workers that exited "engine sick", as a supervisor (compose, systemd) would; any
        other exit of a worker is a broken promise."""
        for wid, p in self.procs.items():
            code = p.poll()
            if code is None:
                continue
            if code != EXIT_ENGINE_SICK:
                raise Broken(f"worker {wid} exited {code} by itself")
            self.sick_exits += 1
            self.start(wid)

    def stalled(self) -> list[str]:
        """The workers whose results disk stalls now (bench/faults.py marks each by its pid)."""
        pids = {int(p.name.rsplit(".", 1)[1]) for p in self.logs.glob(f"{self.slow_disk.name}.held.*")}
        return [wid for wid, p in self.procs.items() if p.pid in pids and p.poll() is None]

    def alive(self, wid: str) -> bool:
        return self.procs[wid].poll() is None

    def freeze(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGSTOP)

    def thaw(self, but: str | None = None) -> None:
        for wid, p in self.procs.items():
            if wid != but and p.poll() is None:
                p.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def stop(self) -> dict[str, int | None]:
        wait_for(lambda: all(self.up(w) for w in self.procs), 300, "every worker up before stopping them", self.revive)
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
        codes = {}
        for wid, p in self.procs.items():
            try:
                codes[wid] = p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                codes[wid] = p.wait()
        return codes


def wait_for(cond: Callable[[], Any], timeout: float, what: str, tick: Callable[[], None] | None = None) -> Any:
    """``cond()`` once true; ``tick()`` before each look (the workers' supervisor)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        try:
            got = cond()
        except (redis.ConnectionError, redis.TimeoutError):
            got = None
        if got:
            return got
        time.sleep(0.1)
    raise Broken(f"timed out after {timeout:.0f}s waiting for {what}")


def check(r: redis.Redis, batch_id: str, total: int, status: str) -> dict[str, int]:
    """Exactly one outcome per job, counters equal to the results (in files, then the stream), nothing
    pending."""
    results: list[Result] = read_results(r, batch_id, "0", 2 * total + 1).results
    idxs = Counter(x.idx for x in results)
    if sorted(idxs) != list(range(total)) or max(idxs.values()) != 1:
        raise Broken(f"{batch_id}: {len(results)} results for {total} jobs; twice: {[i for i, c in idxs.items() if c > 1]}")
    meta = r.hgetall(keys.meta(batch_id))
    by_status = Counter(x.status for x in results)
    for s in ("completed", "failed", "cancelled", "expired"):
        if int(meta.get(s) or 0) != by_status.get(s, 0):
            raise Broken(f"{batch_id}: counter {s}={meta.get(s)} but {by_status.get(s, 0)} results")
    if meta["status"] != status:
        raise Broken(f"{batch_id}: status {meta['status']}, expected {status}")
    for p in (meta.get("priorities") or "").split(","):
        if p and (n := r.xpending(keys.jobs(batch_id, int(p)), keys.GROUP)["pending"]):
            raise Broken(f"{batch_id}: {n} jobs left pending in priority {p}")
    return dict(by_status)


def chaos(args: argparse.Namespace, home: Path, summary: dict[str, Any]) -> None:
    rng = random.Random(args.seed)
    ensure_server(home)
    r = connect()
    b = submit(lines(args.jobs, rng, (args.min_tokens, args.max_tokens), "j"), r=r, model=QUEUE)
    workers = Workers(args.model, args.workers, home, args.max_num_seqs, args.max_deliveries)
    try:
        _run(args, r, b, workers, summary)
    finally:
        workers.kill()  # whatever is still running after a broken promise


def _run(args: argparse.Namespace, r: redis.Redis, b: Any, workers: Workers, summary: dict[str, Any]) -> None:
    home = workers.logs
    rng = random.Random(args.seed + 1)
    events: list[str] = summary.setdefault("events", [])
    t0 = time.monotonic()

    def done() -> int:
        return r.hlen(keys.done(b.id))

    def wait(cond: Callable[[], Any], what: str) -> Any:
        return wait_for(cond, args.timeout, what, workers.revive)

    def at(frac: float) -> None:
        wait(lambda: done() >= frac * args.jobs, f"{frac:.0%} of the batch")

    def holding_worker() -> str:
        """A worker holding jobs of the batch, frozen (SIGSTOP) with every other worker, so that no job can
        finish between choosing it and the fault: the fault lands at this point of the batch's progress
        however fast the machine runs. The caller thaws them. Raises if the batch finished first."""
        wids = list(workers.procs)
        rng.shuffle(wids)

        def frozen_holder() -> str | None:
            if done() >= args.jobs:
                raise Broken("the batch finished before every fault was injected")
            workers.freeze()
            holder = next((w for w in wids if workers.alive(w) and pending_under(r, b.id, w) > 0), None)
            if holder is None:  # between two reads (or all starting): let them run a moment and look again
                workers.thaw()
            return holder

        return wait(frozen_holder, "a worker holding jobs")

    def note(event: str) -> None:
        events.append(f"{time.monotonic() - t0:.1f}s {event}")
        print(events[-1], file=sys.stderr, flush=True)

    def kill() -> None:
        wid = holding_worker()
        workers.procs[wid].kill()
        workers.procs[wid].wait()
        note(f"kill -9 {wid} holding jobs at {done()} done")
        workers.thaw()
        workers.start(wid)

    def slow_disk() -> None:
        """Stall every results chunk write until one stalled worker wrote ``need`` more results of the
        batch meanwhile: writes must not wait on the disk (its own writer and engine run on)."""
        workers.slow_disk.touch()
        try:
            wid = wait(lambda: next(iter(workers.stalled()), None), "a results chunk write to stall")
            last = r.xrevrange(keys.results(b.id), count=1)
            cursor = last[0][0] if last else "0"
            need = max(3, args.jobs // 200)

            def own() -> int:
                return sum(x.worker == wid for x in read_results(r, b.id, cursor, args.jobs).results)

            wait(lambda: own() >= need or done() >= args.jobs, f"{need} results of {wid} while its disk stalls")
            if own() < need or wid not in workers.stalled():
                raise Broken(f"{wid} wrote {own()} results while its disk stalled (need {need}), or it came unstuck")
        finally:
            workers.slow_disk.unlink(missing_ok=True)
        note(f"results disk stalled: {wid} wrote {own()} results while its chunk write hung, at {done()} done")

    victim = poisoned = None
    # Each fault at a point of the batch's progress (jobs done), never at a clock time. The SIGSTOP comes
    # last: while its victim sleeps past the heartbeat TTL the others run on and may finish the batch.
    plan = (["kill", "slow_disk", "cancel", "poison", "kill", "restart_server", "kill"]
            + ["kill"] * max(0, args.kills - 3) + ["stop"])
    steps = len(plan) + 1
    for i, ev in enumerate(plan):
        at((i + 1) / steps * 0.8)
        if ev == "kill":
            kill()
        elif ev == "slow_disk":
            slow_disk()
        elif ev == "poison":
            n = max(10, args.jobs // 50)
            poisoned = submit(poisoned_lines(n, rng), r=r, model=QUEUE, priority=5)
            note(f"submitted {poisoned.id}: {n} jobs and one that breaks the engine")
        elif ev == "cancel":
            victim = submit(lines(args.jobs // 10, rng, (64, 256), "v"), r=r, model=QUEUE, priority=5)
            wait(lambda r=r, v=victim.id: r.hlen(keys.done(v)) + sum(pending_under(r, v, w) for w in workers.procs) > 0,
                 "the other batch under way")
            cancel_batch(r, victim.id)
            note(f"cancelled {victim.id} ({args.jobs // 10} jobs)")
        elif ev == "stop":
            wid = holding_worker()
            workers.thaw(but=wid)
            try:
                time.sleep(HEARTBEAT_TTL * 2 + 1)
            finally:
                workers.thaw()
            note(f"SIGSTOP {wid} for {HEARTBEAT_TTL * 2 + 1:.0f}s, SIGCONT")
        elif ev == "restart_server":
            stop_server(home, kill=True)
            time.sleep(0.5)
            ensure_server(home)
            r.close()
            r = connect()
            note("kill -9 of the Valkey server, restarted (AOF)")
    wait(lambda: (m := get_batch(r, b.id)) is not None and m.is_final, "the batch to finish")
    wall = time.monotonic() - t0
    if poisoned is not None:
        wait(lambda p=poisoned.id: (m := get_batch(r, p)) is not None and m.is_final, "the poisoned batch to finish")
    codes = workers.stop()
    summary.update(wall_s=round(wall, 1), exit_codes=codes, sick_exits=workers.sick_exits)
    if poisoned is not None:
        summary["poisoned_batch"] = check_poisoned(r, poisoned.id, poisoned.counts.total)
    summary["outcomes"] = check(r, b.id, args.jobs, "completed")
    if victim is not None:
        summary["cancelled_batch"] = check(r, victim.id, victim.counts.total, "cancelled")
    dead = dead_letters(r, b.id)
    if dead:
        raise Broken(f"{len(dead)} jobs dead-lettered that did not fail on their own: {dead[0]['error']}")
    if summary["outcomes"] != {"completed": args.jobs}:
        raise Broken(f"not every job completed: {summary['outcomes']}")
    if any(c != 0 for c in codes.values()):
        raise Broken(f"a worker did not drain cleanly: {codes}")


def _terminated(signum: int, frame: Any) -> None:
    """Stopped from outside (a caller's time limit): unwind as for a broken promise, so the workers are
    killed, the server stopped and what happened so far printed."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up itself is not cut short
    raise Broken("terminated (SIGTERM) before the run finished")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (a tiny random model is enough)")
    p.add_argument("--jobs", type=int, default=3000)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--kills", type=int, default=6)
    p.add_argument("--min-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-deliveries", type=int, default=10,
                   help="the workers': more than the times one job can be held by a killed or stopped worker, so that "
                        "no innocent job is dead-lettered; the poison fails after this many engines it broke")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds any one phase may take")
    p.add_argument("--seed", type=int, default=None)
    args = p.parse_args(argv)
    args.seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"chaos seed={args.seed} (replay with --seed {args.seed})", flush=True)
    tmp = None
    if not os.environ.get(ENV_HOME):
        tmp = tempfile.TemporaryDirectory(prefix="sluice-chaos-")
        os.environ[ENV_HOME] = tmp.name
    home = Path(os.environ[ENV_HOME])
    summary: dict[str, Any] = {"seed": args.seed, "jobs": args.jobs, "workers": args.workers}
    signal.signal(signal.SIGTERM, _terminated)
    try:
        chaos(args, home, summary)
        ok = 0
    except Broken as e:
        summary["broken"], ok = str(e), 1
        for log in sorted(home.glob("w*.log")):
            print(f"---- {log.name} (tail)\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
    finally:
        stop_server(home, kill=True)
        if tmp is not None:
            tmp.cleanup()
    print(json.dumps(summary), flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main())
