"""How many files one job's path enters, from submission to its written result (issue 22's check).

    python scripts/job_path.py --tree /path/to/checkout [--model DIR]

Starts an embedded job server and a worker in this process (on a tiny random Llama, PyTorch attention: ``--model``, or one
made with the checkout's tests/support/helpers.py), waits until the worker idles, then traces (sys.settrace,
every thread) while one job is submitted and until its result is in Redis. Per thread, the file that
runs now follows each call into and return out of the checkout's code (other code is passed through);
printed: the files entered, the distinct moves between files, the files returned to after being left,
and the moves in all. A second view folds engine/ and kernels/ into one node (the model's compute), a
third each package into one (moves between jobs/ and worker/: what issue 22 set out to cut).
The idle polls during the trace count too (the same for both trees, a handful of ticks)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


class Tracer:
    def __init__(self, root: Path) -> None:
        self.root = str(root) + os.sep
        self.active = False
        self.seq: dict[int, list[str]] = defaultdict(list)  # thread id -> file that runs, each change
        self.ticks = 0  # the worker loop's turns while tracing: "moves in all" grows with them

    def _file(self, frame: Any) -> str | None:
        f = frame.f_code.co_filename
        if not f.startswith(self.root) or "/scripts/" in f or "/tests/" in f:
            return None
        return f[len(self.root):]

    def _now(self, f: str) -> None:
        s = self.seq[threading.get_ident()]
        if not s or s[-1] != f:
            s.append(f)

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if not self.active or event != "call":
            return None
        f = self._file(frame)
        if f is None:
            return None
        self.ticks += frame.f_code.co_name == "_tick" and f == "worker/worker.py"
        self._now(f)
        return self._local

    def _local(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "return" and self.active:
            back = frame.f_back
            while back is not None and self._file(back) is None:
                back = back.f_back
            if back is not None:
                self._now(self._file(back))  # type: ignore[arg-type]
        return self._local


def summarize(seqs: dict[int, list[str]], fold: str) -> dict[str, Any]:
    """Files entered, distinct moves (from -> to) and distinct files returned to after being left; and
    the moves in all (this one grows with the worker's loop ticks while the job runs, so with timing)."""

    def node(f: str) -> str:
        top = f.split("/")[0]
        if fold == "package":
            return "engine+kernels" if top in ("engine", "kernels") else top
        return "engine+kernels" if fold == "engine" and top in ("engine", "kernels") else f

    files: set[str] = set()
    edges: set[tuple[str, str]] = set()
    returned: set[str] = set()
    moves = 0
    for s in seqs.values():
        path = [node(f) for f in s]
        path = [f for i, f in enumerate(path) if i == 0 or path[i - 1] != f]
        seen: set[str] = set()
        for i, f in enumerate(path):
            if i:
                moves += 1
                edges.add((path[i - 1], f))
                if f in seen:
                    returned.add(f)
            seen.add(f)
        files |= seen
    return {"files entered": len(files), "distinct moves": len(edges), "files returned to": len(returned),
            "moves in all": moves, "threads": sum(1 for s in seqs.values() if s)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, required=True, help="the checkout whose code runs")
    p.add_argument("--model", type=Path, default=None, help="a tiny model directory (default: made now)")
    p.add_argument("--list", action="store_true", help="also print each thread's files in order")
    args = p.parse_args()
    tree = args.tree.resolve()
    sys.path[:0] = [str(tree), str(tree / "tests" / "support")]
    home = Path(tempfile.mkdtemp(prefix="job-path-"))
    os.environ["SLUICE_HOME"] = str(home)
    os.environ.pop("SLUICE_REDIS_URL", None)
    model = args.model or importlib.import_module("helpers").make_tiny_model(home / "model", seed=0)

    conn = importlib.import_module("sluice.jobs.connection" if (tree / "jobs" / "connection.py").exists() else "jobs.server")
    from sluice.engine.llm import LLM
    from sluice.jobs.submit import submit
    from sluice.worker.options import WorkerOptions
    from sluice.worker.worker import Worker

    conn.ensure_server(home)
    r = conn.connect()
    llm = LLM(str(model), dtype="float32", kv_cache_memory=4 << 20, max_num_seqs=4, attention_backend="torch")
    stop = threading.Event()
    tracer = Tracer(tree)
    threading.settrace(tracer)  # every thread the worker starts; it records only while active
    worker = Worker(llm, WorkerOptions(queue="tiny", poll_interval=0.05), stop)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    time.sleep(3.0)  # started, idle: its threads are up
    sys.settrace(tracer)
    tracer.active = True
    t0 = time.monotonic()
    line = json.dumps({"custom_id": "one", "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True})
    b = submit([line], r=r, model="tiny")
    done = f"sluice:{{{b.id}}}:done"
    while not r.hlen(done):
        if time.monotonic() - t0 > 120:
            raise SystemExit("no result in 120 s")
        time.sleep(0.005)
    tracer.active = False
    sys.settrace(None)
    threading.settrace(None)  # type: ignore[arg-type]
    stop.set()
    thread.join(60)
    conn.stop_server(home)
    out = {"tree": str(tree), "worker loop ticks": tracer.ticks, "all files": summarize(tracer.seq, fold=""),
           "engine and kernels folded": summarize(tracer.seq, fold="engine"),
           "packages (jobs, worker, engine+kernels)": summarize(tracer.seq, fold="package")}
    print(json.dumps(out, indent=1))
    if args.list:
        for tid, s in tracer.seq.items():
            print(f"thread {tid}: " + " > ".join(s))


if __name__ == "__main__":
    main()
