"""The online path (``/v1/chat/completions`` with N concurrent clients) against the batch path (the same
prompts as one batch), through the real system: an embedded Valkey in a temporary SLUICE_HOME, one
``python -m sluice.worker`` and one ``sluice serve``, each its own process.

    python bench/online_throughput.py                                   # SmolLM2, 1024 prompts x 64 tokens
    python bench/online_throughput.py --model /path/to/tiny --requests 64 --clients 4,16 --max-tokens 8

Prompts: the shared vicuna/mt-bench first turns (cycled to --requests), greedy, ignore_eos, so every
request makes exactly --max-tokens tokens. For each client count: requests/s, output tokens/s, and the
latency percentiles (request to answer) seen by the clients (the unmodified ``openai`` AsyncOpenAI).
The batch path: the same requests submitted as one batch, timed from submission to its last result.
The issue's target: online tokens/s >= 80% of the batch path's at 256 clients. Writes JSON to bench/out/.
Measure on an otherwise idle machine: a shared box's numbers say nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT.parent / "shared" / "data" / "prompts"
OUT = ROOT / "bench" / "out"
QUEUE = "bench"


def load_prompts(n: int) -> list[str]:
    rows: list[str] = []
    for name in ("vicuna_bench.jsonl", "mt_bench.jsonl"):
        f = PROMPTS / name
        if f.exists():
            for line in f.read_text().splitlines():
                obj = json.loads(line)
                turn = obj.get("turns", [obj.get("prompt") or obj.get("text") or ""])[0]
                if turn:
                    rows.append(turn)
    rows = rows or [f"Write a short story about the number {i}." for i in range(64)]
    return [rows[i % len(rows)] for i in range(n)]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def wait_until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


def private_home(tmp: Path) -> Path:
    """A SLUICE_HOME of this run's own (its own embedded job server), set for this process and its children."""
    home = tmp / "home"
    home.mkdir()
    os.environ["SLUICE_HOME"] = str(home)
    os.environ.pop("SLUICE_REDIS_URL", None)
    return home


def stop_system(procs: list[subprocess.Popen], home: Path) -> None:
    """The API and worker processes (last started first), then the job server."""
    for proc in reversed(procs):
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    from sluice.jobs.connection import stop_server

    stop_server(home, kill=True)


def start_system(args: argparse.Namespace, home: Path, env: dict[str, str]) -> tuple[list[subprocess.Popen], str]:
    from sluice.jobs import keys
    from sluice.jobs.connection import connect, ensure_server

    ensure_server(home)
    r = connect()
    wcmd = [sys.executable, "-m", "sluice.worker", "--queue", QUEUE, "--worker-id", "bench-worker"]
    if args.model:
        wcmd += ["--model", args.model]
    wcmd += args.worker_args.split()
    log = open(home / "worker.log", "ab")  # noqa: SIM115 - the child owns it
    worker = subprocess.Popen(wcmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wait_until(lambda: r.exists(keys.heartbeat("bench-worker")), 600, "the worker (see worker.log)")
    sluice = str(Path(sys.executable).with_name("sluice"))
    slog = open(home / "serve.log", "ab")  # noqa: SIM115
    serve = subprocess.Popen([sluice, "serve", "--port", str(args.port), "--log-level", "warning"], cwd=ROOT, env=env,
                             stdout=slog, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"

    def up() -> bool:
        import httpx

        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 120, "sluice serve (see serve.log)")
    return [worker, serve], url


def batch_path(prompts: list[str], max_tokens: int) -> dict[str, Any]:
    from sluice.jobs.connection import connect
    from sluice.jobs.store import get_batch
    from sluice.jobs.submit import submit

    lines = [json.dumps({"custom_id": f"b{i}", "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens,
                         "ignore_eos": True, "temperature": 0}) for i, p in enumerate(prompts)]
    r = connect()
    t0 = time.monotonic()
    batch = submit(lines, r=r, model=QUEUE)
    while not batch.is_final:
        time.sleep(0.05)
        got = get_batch(r, batch.id)
        assert got is not None
        batch = got
    wall = time.monotonic() - t0
    return {"requests": len(prompts), "wall_s": wall, "requests_per_s": len(prompts) / wall,
            "tokens_per_s": batch.usage.completion_tokens / wall, "completed": batch.counts.completed}


async def online_path(url: str, prompts: list[str], max_tokens: int, clients: int) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=os.environ.get("SLUICE_API_KEY", "unused"),
                                max_retries=0, timeout=3600)
    todo = list(enumerate(prompts))
    latencies: list[float] = []
    tokens = 0
    errors: dict[str, int] = {}

    async def one_client() -> None:
        nonlocal tokens
        while todo:
            _, p = todo.pop()
            t = time.monotonic()
            try:
                resp = await client.chat.completions.create(model=QUEUE, messages=[{"role": "user", "content": p}],
                                                            max_tokens=max_tokens, temperature=0,
                                                            extra_body={"ignore_eos": True})
            except openai.APIError as e:  # counted, not fatal: a run with errors says so in its report
                name = type(e).__name__
                errors[name] = errors.get(name, 0) + 1
                continue
            latencies.append(time.monotonic() - t)
            tokens += resp.usage.completion_tokens if resp.usage else 0

    t0 = time.monotonic()
    await asyncio.gather(*(one_client() for _ in range(clients)))
    wall = time.monotonic() - t0
    await client.close()
    return {"clients": clients, "requests": len(prompts), "answered": len(latencies), "errors": errors,
            "wall_s": wall, "requests_per_s": len(latencies) / wall,
            "tokens_per_s": tokens / wall, "latency_p50_s": percentile(latencies, 0.5),
            "latency_p90_s": percentile(latencies, 0.9), "latency_p99_s": percentile(latencies, 0.99),
            "latency_mean_s": statistics.fmean(latencies) if latencies else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path or name (default: the worker's, SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--clients", default="16,64,256", help="comma-separated concurrent client counts")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--worker-args", default="", help="extra `python -m sluice.worker` flags, e.g. '--dtype float32'")
    p.add_argument("--out", type=Path, default=None, help="JSON output (default: bench/out/online_<time>.json)")
    args = p.parse_args()

    prompts = load_prompts(args.requests)
    with tempfile.TemporaryDirectory(prefix="sluice-online-") as tmp:
        home = private_home(Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        procs, url = start_system(args, home, env)
        try:
            asyncio.run(online_path(url, prompts[: min(8, len(prompts))], args.max_tokens, 4))  # warm up
            batch = batch_path(prompts, args.max_tokens)
            print(f"batch path: {batch['requests_per_s']:.1f} req/s, {batch['tokens_per_s']:.0f} tok/s "
                  f"({batch['wall_s']:.1f}s)", flush=True)
            online = []
            for n in (int(x) for x in args.clients.split(",")):
                res = asyncio.run(online_path(url, prompts, args.max_tokens, n))
                res["of_batch_tokens_per_s"] = res["tokens_per_s"] / batch["tokens_per_s"]
                res["of_batch_requests_per_s"] = res["requests_per_s"] / batch["requests_per_s"]
                online.append(res)
                failed = f", {sum(res['errors'].values())} FAILED {res['errors']}" if res["errors"] else ""
                print(f"{n:4d} clients: {res['requests_per_s']:.1f} req/s, {res['tokens_per_s']:.0f} tok/s "
                      f"({100 * res['of_batch_tokens_per_s']:.0f}% of batch), latency p50 {res['latency_p50_s']:.2f}s "
                      f"p90 {res['latency_p90_s']:.2f}s p99 {res['latency_p99_s']:.2f}s ({res['wall_s']:.1f}s)"
                      f"{failed}", flush=True)
        finally:
            stop_system(procs, home)
    report = {"model": args.model, "requests": args.requests, "max_tokens": args.max_tokens, "batch": batch,
              "online": online}
    out = args.out or OUT / f"online_{time.strftime('%Y%m%d_%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
