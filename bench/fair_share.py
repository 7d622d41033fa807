"""Fair share and priority preemption (issue 43, item 7), on the default model:

    python bench/fair_share.py                 # 20,000-line batch, then a 20-line one; then the urgent request
    python bench/fair_share.py --big 2000 --small 20 --max-tokens 8

1. Two batches on one queue, a worker in this process: the big one submitted first, the small one right
   after, at the same priority. Reported: how many of the big batch's jobs had finished, and how many
   engine steps had run, when the small batch finished (first come first served: after all of the big one).
2. An engine full of batch sequences (max_num_seqs of them running, more waiting), then one urgent request:
   steps and seconds to its first token at the batch's priority and at the API's interactive priority (100).
Needs no server of its own: an embedded job server in a temporary SLUICE_HOME.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from throughput import describe_cpu, machine  # noqa: E402


def lines(n: int, rng: random.Random, max_tokens: int, tag: str) -> list[str]:
    words = "river stone cloud lamp orchard copper violin harbor meadow lantern".split()
    return [json.dumps({"custom_id": f"{tag}{i}", "max_tokens": max_tokens,
                        "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(8, 24)))}) for i in range(n)]


def fair_share(args: argparse.Namespace) -> dict[str, Any]:
    from sluice.engine.llm import LLM
    from sluice.jobs import keys
    from sluice.jobs.connection import connect
    from sluice.jobs.store import get_batch
    from sluice.jobs.submit import submit
    from sluice.worker.worker import Worker, WorkerOptions

    r = connect()
    rng = random.Random(0)
    big = submit(lines(args.big, rng, args.max_tokens, "big"), r=r, model="bench")
    small = submit(lines(args.small, rng, args.max_tokens, "small"), r=r, model="bench")
    llm = LLM(None, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    stop = threading.Event()
    worker = Worker(llm, WorkerOptions(queue="bench"), stop)
    thread = threading.Thread(target=worker.run, daemon=True)
    t0 = time.perf_counter()
    thread.start()
    while not get_batch(r, small.id).is_final:
        time.sleep(0.05)
    out = {"big_jobs": args.big, "small_jobs": args.small, "big_done_when_small_finished": r.hlen(keys.done(big.id)),
           "engine_steps": llm.num_steps, "seconds": time.perf_counter() - t0}
    stop.set()
    thread.join(120)
    return out


def urgent_ttft(args: argparse.Namespace) -> dict[str, Any]:
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

    out: dict[str, Any] = {}
    for priority in (0, 100):
        rng = random.Random(1)
        llm = LLM(None, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
        for i in range(2 * args.max_num_seqs):
            ids = [rng.randrange(100, 20000) for _ in range(rng.randint(100, 300))]
            llm.add_request(Request(f"b{i}", prompt_token_ids=ids, params=SamplingParams(max_tokens=256, ignore_eos=True)))
        while llm.num_waiting > args.max_num_seqs:
            llm.step()
        while llm.num_waiting and llm.num_running < args.max_num_seqs:
            llm.step()
        ids = [rng.randrange(100, 20000) for _ in range(200)]
        llm.add_request(Request("urgent", prompt_token_ids=ids, params=SamplingParams(max_tokens=8),
                                priority=priority))
        t, steps = time.perf_counter(), 0
        while len((llm.tokens_so_far("urgent") or (len(ids), [ids]))[1][0]) <= len(ids):
            done = llm.step()
            steps += 1
            if any(c.request_id == "urgent" for c in done):
                break
        out[f"priority_{priority}"] = {"steps": steps, "seconds": time.perf_counter() - t,
                                       "preemptions": llm.scheduler.num_preemptions}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--big", type=int, default=20_000)
    p.add_argument("--small", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    os.environ.setdefault("SLUICE_HOME", tempfile.mkdtemp(prefix="sluice-fair-"))
    os.environ.pop("SLUICE_REDIS_URL", None)
    report = {"machine": describe_cpu(machine()), "args": vars(args), "fair_share": fair_share(args),
              "urgent": urgent_ttft(args)}
    print(json.dumps(report, indent=1))
    from sluice.jobs.connection import stop_server

    stop_server(None)


if __name__ == "__main__":
    main()
