"""Dynamic LoRA throughput: the chat workload with its lines spread over 64 adapters the engine was never told
about (rank 16, every q/k/v/o/gate/up/down), loaded on demand from an adapter root into 8 slots (and a CPU
cache of 32), against the base model alone, on the default model.

    python bench/lora_dynamic.py                                          # 64 adapters over 8 slots, 3 rounds
    python bench/lora_dynamic.py --num-prompts 16 --max-tokens 8 --adapters 4 --max-loras 2 --rounds 1 --tag dyn-smoke

Each configuration runs in a fresh process (this script, ``--child``), greedy with EOS ignored (equal work).
Line i names adapter i mod N; nothing is loaded before the clock starts (a few base lines warm the engine), so
the adapters' reads from disk, their copies into slots, evictions and the lines waiting for a free slot are all
in the time. The adapters are made with peft once (bench/lora_throughput.py's make_adapters) and kept in
bench/out/lora-adapters/. Base and adapters take turns for ``--rounds`` rounds; each round's ratio is to the
base run beside it and the median is the result. Writes bench/out/TAG.json and TAG.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402  (bench/workloads.py, beside this file)
from lora_throughput import make_adapters  # noqa: E402


def child(args: argparse.Namespace) -> None:
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

    w = json.loads(args.workload.read_text())
    kw: dict[str, Any] = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory}
    names: list[str | None] = [None]
    if args.child_adapters:
        kw.update(lora_roots=[w["root"]], max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
                  max_lora_rank=w["rank"])
        names = [f"r{w['rank']}-{i}" for i in range(args.child_adapters)]  # the adapters' folder names
    llm = LLM(w["model"], **kw)
    ids, max_tokens = w["prompt_token_ids"], w["max_tokens"]

    def requests(prefix: str, prompts: list[list[int]], n: int, lora: list[str | None]) -> list[Request]:
        return [Request(f"{prefix}{i}", prompt_token_ids=p, lora=lora[i % len(lora)],
                        params=SamplingParams(max_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)]

    llm.generate(requests("warm", [x[:8] for x in ids[:4]], 4, [None]))  # the engine warm, no adapter loaded
    t = time.perf_counter()
    out = llm.generate(requests("b", ids, max_tokens, names))
    secs = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for c in out)
    errors = [c.error for c in out if c.error]
    cache = llm.lora.cache if llm.lora is not None else None
    result = {"adapters": args.child_adapters, "seconds": secs, "output_tokens": tokens, "tokens_per_s": tokens / secs,
              "errors": errors[:3], "reads": cache.num_loads if cache else 0,
              "slot_loads": cache.num_slot_loads if cache else 0}
    args.result.write_text(json.dumps(result))
    print(f"{args.child_adapters} adapters: {tokens / secs:.1f} tok/s ({tokens} tokens, {secs:.1f}s)", flush=True)


def run_child(args: argparse.Namespace, workload: Path, k: int, round_: int) -> dict[str, Any]:
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    name = f"{args.tag}-{k}-round{round_}"
    log, result = logs / f"{name}.log", OUT / "tmp" / f"{name}.json"
    result.unlink(missing_ok=True)
    cmd = [sys.executable, __file__, "--child-adapters", str(k), "--workload", str(workload), "--result", str(result),
           "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory",
           str(args.kv_cache_memory), "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras)]
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=f,
                            stderr=subprocess.STDOUT).returncode
    if rc != 0 or not result.exists():
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        return {"adapters": k, "error": f"exit {rc}; log {log}: {tail}"}
    return json.loads(result.read_text())


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    from throughput import machine
    from throughput_report import describe_cpu

    lines = [f"Dynamic LoRA: {args.num_prompts} prompts x {args.max_tokens} tokens (chat, EOS ignored), rank {args.rank}, "
             f"{args.dtype}, {args.adapters} adapters loaded on demand into {args.max_loras} slots "
             f"(CPU cache {args.max_cpu_loras}), {args.rounds} round(s); {describe_cpu(machine())}", "",
             f"Command: `python bench/lora_dynamic.py {' '.join(sys.argv[1:])}`", "",
             "| round | lines over | tokens/s | reads from disk | slot loads | vs base, same round |",
             "|---:|---|---:|---:|---:|---:|"]
    ratios = []
    for r in rows:
        what = "base alone" if r["adapters"] == 0 else f"{r['adapters']} adapters"
        if "error" in r:
            lines.append(f"| {r['round']} | {what} | failed: {r['error']} | | | |")
            continue
        base = next((b.get("tokens_per_s") for b in rows if b["round"] == r["round"] and b["adapters"] == 0), None)
        ratio = "-"
        if base and r["adapters"]:
            ratios.append(r["tokens_per_s"] / base)
            ratio = f"{ratios[-1]:.2f}x"
        lines.append(f"| {r['round']} | {what} | {r['tokens_per_s']:.1f} | {r['reads']} | {r['slot_loads']} | {ratio} |")
    if ratios:
        lines += ["", f"median ratio to the base alone: {statistics.median(ratios):.2f}x"]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="as for sluice --model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--max-loras", type=int, default=8)
    p.add_argument("--max-cpu-loras", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="bytes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tag", default="lora-dynamic")
    p.add_argument("--child-adapters", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_adapters is not None:
        child(args)
        return
    from sluice.engine.loader import dense_path, load_tokenizer, resolve_model

    root = OUT / "lora-adapters"
    make_adapters(dense_path(resolve_model(args.model)), root, args.adapters, args.rank)
    ids = workloads.build("chat", load_tokenizer(args.model), args.num_prompts)
    workload = OUT / "tmp" / f"{args.tag}-workload.json"
    workload.parent.mkdir(parents=True, exist_ok=True)
    workload.write_text(json.dumps({"model": args.model, "prompt_token_ids": ids, "max_tokens": args.max_tokens,
                                    "root": str(root), "rank": args.rank}))
    rows = []
    for i in range(1, args.rounds + 1):
        for k in (0, args.adapters):
            row = {"round": i, **run_child(args, workload, k, i)}
            rows.append(row)
            got = f"{row['tokens_per_s']:.1f} tok/s" if "tokens_per_s" in row else row["error"]
            print(f"round {i}, {k} adapters: {got}", flush=True)
    (OUT / f"{args.tag}.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))
    table = markdown(rows, args)
    (OUT / f"{args.tag}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
