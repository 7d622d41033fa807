"""vLLM's CPU build on bench/throughput.py's workload, alone in its own process and virtual environment.

    bench/.vllm-venv/bin/python bench/vllm_run.py WORKLOAD.json RESULT.json --dtype float32

Run by bench/throughput.py (which sets the threads, tcmalloc and libiomp5 in the environment); it imports
nothing from the project, since the project's packages are not in vLLM's venv. The workload is the same
chat token ids every system gets; the result has the same shape as bench/run_system.py's.
With --profile DIR, a second, short run under vLLM's torch profiler writes its table of time by op there
(not timed: the profiler slows the run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any


def build_llm(model_dir: str, dtype: str, max_num_seqs: int, max_num_batched_tokens: int, kv_bytes: int,
              profile_dir: str | None) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if profile_dir:
        # Stack traces off: with them the table's rows split by call site and the run crawls.
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(Path(profile_dir).resolve()),
                                 "torch_profiler_with_stack": False, "ignore_frontend": True}
    return LLM(model=model_dir, dtype=dtype, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, seed=0,
               # A KV cache of the size Sluice gets; without it vLLM's CPU build reserves a share of all
               # memory and refuses to start where other processes hold some.
               kv_cache_memory_bytes=kv_bytes, **kw)


GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "n": 1, "seed": None, "stop": []}


def sampling(w: dict[str, Any]) -> dict[str, Any]:
    """The workload's sampling settings (a workload written before --workload has a temperature only)."""
    return w.get("sampling") or {**GREEDY, "temperature": w["temperature"], "seed": 0 if w["temperature"] else None}


def generate(llm: Any, prompts: list[list[int]], max_tokens: int, s: dict[str, Any]) -> list[list[int]]:
    """Every sample of every prompt, prompt by prompt. Unseeded: vLLM's CPU build refuses a seed per
    request, so it samples from its engine-wide seed."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = {"top_k": s["top_k"]} if s["top_k"] else {}
    params = SamplingParams(max_tokens=max_tokens, temperature=s["temperature"], top_p=s["top_p"], n=s["n"],
                            stop=list(s["stop"]) or None, **kw)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(c.token_ids) for o in outs for c in o.outputs]


def profile(llm: Any, prompts: list[list[int]], max_tokens: int, s: dict[str, Any], steps: int) -> None:
    """A few decode steps of the full batch under vLLM's profiler (it writes its own table)."""
    # Skip the prefill steps: the decode steps at full batch are what the timed run is made of.
    llm.start_profile(delay_iterations=4, max_iterations=steps)
    generate(llm, prompts, min(max_tokens, steps + 8), s)
    llm.stop_profile()


def summarize_profile(table: str) -> dict[str, float]:
    """Shares of self CPU time in vLLM's profiler table: matmuls (oneDNN), attention (its paged-cache
    kernels and cache writes), and the rest (the compiled graph's own fused code, sampling, glue)."""
    shares = {"matmuls": 0.0, "attention": 0.0, "other": 0.0}
    for line in table.splitlines():
        m = re.match(r"\s*(.+?)\s{2,}([\d.]+)%\s", line)
        if not m:
            continue
        name, pct = m[1], float(m[2])
        if "_mm" in name or name in ("aten::mm", "aten::addmm", "aten::linear", "aten::bmm"):
            shares["matmuls"] += pct
        elif "attn" in name or "attention" in name or "reshape_and_cache" in name:
            shares["attention"] += pct
        else:
            shares["other"] += pct
    return shares


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", type=Path)
    p.add_argument("result", type=Path)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="bytes")
    p.add_argument("--profile", default=None, help="directory for a profiled run's table (not timed)")
    p.add_argument("--profile-steps", type=int, default=8)
    args = p.parse_args()
    w = json.loads(args.workload.read_text())
    import torch
    import vllm

    llm = build_llm(w["model_dir"], args.dtype, args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory,
                    args.profile)
    generate(llm, [w["prompt_token_ids"][0][:8]], 4, sampling(w))  # warm-up, as bench/run_system.py does for the others
    t = time.perf_counter()
    outputs = generate(llm, w["prompt_token_ids"], w["max_tokens"], sampling(w))
    secs = time.perf_counter() - t
    tokens = sum(map(len, outputs))
    result = {"system": "vllm", "dtype": args.dtype, "seconds": secs, "output_tokens": tokens,
              "prompts": len(outputs), "tokens_per_s": tokens / secs, "outputs": outputs,
              "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
              "seeded": False, "threads": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
              "settings": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}}
    if args.profile:
        profile(llm, w["prompt_token_ids"], w["max_tokens"], sampling(w), args.profile_steps)
        result["profile_dir"] = args.profile
        tables = sorted(Path(args.profile).glob("*profiler_out.txt"))
        if tables:
            result["profile"] = summarize_profile(tables[-1].read_text())
    args.result.write_text(json.dumps(result))
    print(f"vllm {args.dtype}: {tokens / secs:.1f} tok/s ({tokens} tokens, {secs:.1f}s)", flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
