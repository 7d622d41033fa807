"""int8 weight-only against dense weights: tokens/s, weight bytes, KV blocks and peak memory, one run each.

    python bench/quant_throughput.py                      # the default model, 160 chat prompts x 256 tokens:
                                                          # float32, bfloat16, and int8 weight-only in each
    python bench/quant_throughput.py --num-prompts 8 --max-tokens 16 --tag quant-smoke     # a quick check
    python bench/quant_throughput.py --configs bfloat16:auto,bfloat16:int8 --model-impl transformers
    python bench/quant_throughput.py --gemm               # the int8 GEMMs alone (engine/quant/int8.py)

A config is DTYPE:QUANTIZATION (``sluice --dtype`` and ``--quantization``). Each runs in a fresh process
(bench/quant_throughput.py --child) on the same prompt token ids (bench/workloads.py's chat workload,
greedy), after one short warm-up, with ``cpu_linear`` auto (the dense head and dense models get the
fastest measured GEMM). Reported per config: output tokens/s, the weights' real bytes (what the KV sizing
takes away from a memory budget), the KV blocks a ``--memory-budget`` leaves (weights + KV cache), the
process's RSS after the run and at its peak (the load's dense copy), and how many prompts' greedy tokens
are identical to the dense run in the same dtype.
``--gemm`` times, interleaved and best-of-N, a decode layer's GEMMs at a few row counts: dense (F.linear),
ATen's ``_weight_int8pack_mm`` and dequantize-on-the-fly, the two int8 GEMMs Int8Linear chooses between.
Writes bench/out/TAG.json and TAG.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402  (bench/workloads.py, beside this file)

OUT = HERE / "out"
DEFAULT_CONFIGS = "float32:auto,float32:int8,bfloat16:auto,bfloat16:int8"


# ---- one config, in its own process ------------------------------------------------------------
def run_child(args: argparse.Namespace) -> None:
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.quant.weight_bytes import weight_bytes
    from sluice.engine.sampling_params import SamplingParams

    w = json.loads(Path(args.workload).read_text())
    dtype, quantization = args.child.split(":")
    kw: dict[str, Any] = dict(dtype=dtype, quantization=quantization, max_num_seqs=args.max_num_seqs,
                              memory_budget=args.memory_budget)
    if args.model_impl:
        kw["model_impl"] = args.model_impl
    t0 = time.perf_counter()
    llm = LLM(w["model"], **kw)
    load_s = time.perf_counter() - t0

    def requests(ids: list[list[int]], max_tokens: int) -> list[Request]:
        return [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=max_tokens, temperature=0.0))
                for i, p in enumerate(ids)]

    llm.generate(requests(w["prompt_token_ids"][:4], 4))  # warm-up: first calls' one-off set-up
    t0 = time.perf_counter()
    done = llm.generate(requests(w["prompt_token_ids"], w["max_tokens"]))
    seconds = time.perf_counter() - t0
    out = [c.outputs[0].token_ids for c in done]
    result = {"config": args.child, "model_impl": llm.model_impl, "quantization": llm.quantization,
              "load_s": load_s, "seconds": seconds, "output_tokens": sum(map(len, out)),
              "tokens_per_s": sum(map(len, out)) / seconds, "weight_bytes": weight_bytes(llm.runner.model),
              "kv_blocks": llm.num_total_blocks, "kv_bytes_per_block": llm.runner.bytes_per_block(),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "rss_after_bytes": _rss_now(), "tokens": out}
    Path(args.result).write_text(json.dumps(result))


def _rss_now() -> int:
    """The process's resident bytes now (after the run: the weights and KV cache held, not the load's peak,
    which the dense copy transformers loads first dominates)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def run_config(config: str, args: argparse.Namespace, workload: Path) -> dict[str, Any] | None:
    result = OUT / f"{args.tag}.{config.replace(':', '-')}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", config, "--workload", str(workload),
           "--result", str(result), "--max-num-seqs", str(args.max_num_seqs), "--memory-budget", str(args.memory_budget)]
    if args.model_impl:
        cmd += ["--model-impl", args.model_impl]
    log = OUT / "logs" / f"{args.tag}.{config.replace(':', '-')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE.parent, timeout=args.timeout).returncode
    if rc != 0:
        print(f"{config}: failed (exit {rc}); see {log}", flush=True)
        return None
    return json.loads(result.read_text())


# ---- the GEMMs alone ---------------------------------------------------------------------------
def gemm_table(model: str | None, rows: list[int], repeats: int) -> str:
    import torch
    import torch.nn.functional as F
    from sluice.engine.linear import model_gemm_shapes
    from sluice.engine.loader import load_config
    from sluice.engine.quant.int8 import quantize_per_channel

    shapes = model_gemm_shapes(load_config(model)).layer
    gen = torch.Generator().manual_seed(0)
    lines = ["| dtype | rows | dense F.linear ms | _weight_int8pack_mm ms | dequantize + F.linear ms |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for dtype in (torch.float32, torch.bfloat16):
        for n_rows in rows:
            runs: dict[str, list[Any]] = {"dense": [], "int8pack": [], "dequant": []}
            for k, n in shapes:
                w = torch.randn(n, k, generator=gen)
                q, s = quantize_per_channel(w)
                x, wd, sd = torch.randn(n_rows, k, generator=gen).to(dtype), w.to(dtype), s.to(dtype)
                runs["dense"].append(lambda x=x, wd=wd: F.linear(x, wd))
                runs["int8pack"].append(lambda x=x, q=q, sd=sd: torch._weight_int8pack_mm(x, q, sd))
                runs["dequant"].append(lambda x=x, q=q, sd=sd: F.linear(x, q.to(x.dtype)) * sd)
            best = {name: [float("inf")] * len(shapes) for name in runs}
            with torch.inference_mode():
                for fs in runs.values():
                    for f in fs:
                        f()
                for _ in range(repeats):  # interleaved: a busy machine slows every kernel alike
                    for name, fs in runs.items():
                        for i, f in enumerate(fs):
                            t0 = time.perf_counter()
                            f()
                            best[name][i] = min(best[name][i], time.perf_counter() - t0)
            ms = {name: sum(b) * 1e3 for name, b in best.items()}
            lines.append(f"| {str(dtype).removeprefix('torch.')} | {n_rows} | {ms['dense']:.3f} | "
                         f"{ms['int8pack']:.3f} | {ms['dequant']:.3f} |")
    return "\n".join(lines)


# ---- the report --------------------------------------------------------------------------------
def agreement(rows: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Per config: prompts whose greedy tokens equal the dense run's in the same dtype."""
    out = {}
    for config, r in rows.items():
        dense = rows.get(config.split(":")[0] + ":auto")
        if dense is None or dense is r:
            continue
        same = sum(a == b for a, b in zip(r["tokens"], dense["tokens"], strict=True))
        out[config] = f"{same}/{len(r['tokens'])}"
    return out


def markdown(rows: dict[str, dict[str, Any]], args: argparse.Namespace, n: int) -> str:
    agree = agreement(rows)
    lines = [f"{n} prompts x {args.max_tokens} tokens, greedy, max_num_seqs {args.max_num_seqs}, memory budget "
             f"{args.memory_budget / 2**30:.1f} GiB (weights + KV cache)", "",
             "| config | path | tokens/s | weights MB | KV blocks | RSS after MB | peak RSS MB | identical to dense |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for config, r in rows.items():
        lines.append(f"| {config} | {r['model_impl']} ({r['quantization']}) | {r['tokens_per_s']:.1f} | "
                     f"{r['weight_bytes'] / 1e6:.1f} | {r['kv_blocks']} | {r['rss_after_bytes'] / 1e6:.0f} | "
                     f"{r['peak_rss_bytes'] / 1e6:.0f} | "
                     f"{agree.get(config, '-')} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="as for sluice --model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated DTYPE:QUANTIZATION")
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--memory-budget", type=int, default=2 << 30, help="bytes for weights + KV cache")
    p.add_argument("--model-impl", default=None, help="passed to Sluice's LLM as model_impl")
    p.add_argument("--gemm", action="store_true", help="time the int8 GEMMs alone, then stop")
    p.add_argument("--gemm-rows", default="1,16,128")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--timeout", type=float, default=None, help="seconds for each config's process")
    p.add_argument("--tag", default="quant")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        run_child(args)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    if args.gemm:
        table = gemm_table(args.model, [int(r) for r in args.gemm_rows.split(",")], args.repeats)
        (OUT / f"{args.tag}-gemm.md").write_text(table + "\n")
        print(table)
        return
    from sluice.engine.loader import load_tokenizer

    ids = workloads.build("chat", load_tokenizer(args.model), args.num_prompts)
    workload = OUT / f"{args.tag}.workload.json"
    workload.write_text(json.dumps({"model": args.model, "prompt_token_ids": ids, "max_tokens": args.max_tokens}))
    rows: dict[str, dict[str, Any]] = {}
    for config in args.configs.split(","):
        r = run_config(config, args, workload)
        if r is not None:
            rows[config] = r
            print(f"{config}: {r['tokens_per_s']:.1f} tok/s, weights {r['weight_bytes'] / 1e6:.1f} MB, "
                  f"{r['kv_blocks']} KV blocks, peak RSS {r['peak_rss_bytes'] / 1e6:.0f} MB", flush=True)
    table = markdown(rows, args, len(ids))
    (OUT / f"{args.tag}.json").write_text(json.dumps({k: {**v, "tokens": None} for k, v in rows.items()}, indent=1))
    (OUT / f"{args.tag}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
