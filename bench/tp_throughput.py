"""Tensor parallelism on this machine: the same workload at --tensor-parallel-size 1 and 2 (and more).

    python bench/tp_throughput.py                           # TP 1 and 2, 64 prompts x 128 tokens, float32
    python bench/tp_throughput.py --tp 1,2 --num-prompts 16 --max-tokens 32

On a CPU the ranks split the host's cores (each rank gets cores // N threads) and pay a gloo all_reduce
twice per layer plus a metadata broadcast per step, so TP=2 is expected to be slower than TP=1 here:
the point of CPU runs is correctness, the speed-up is for GPUs (one per rank, NCCL). The model has random
weights in a divisible shape (SmolLM2-135M's 9 heads over 3 KV heads do not split in two): 30 layers of
hidden 512, 8 heads over 4 KV heads of 64, SmolLM2's vocabulary; EOS is ignored, every request generates
--max-tokens. Each size runs in a process of its own after a short warm-up; greedy tokens must agree.
Writes bench/out/TAG.json and prints a table with the load average (other work on the host skews it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.append(str(ROOT))  # after site-packages: our kernels/ must not hide transformers' kernels

SHAPE = dict(vocab_size=49152, hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True,
             bos_token_id=1, eos_token_id=2)


def make_model(path: Path, seed: int) -> Path:
    import torch
    from sluice.engine.loader import DEFAULT_MODEL, dense_path, resolve_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(dense_path(resolve_model(DEFAULT_MODEL))).save_pretrained(path)
    return path


def run_one(model_dir: str, tp: int, work: list[list[int]], max_tokens: int, dtype: str, max_num_seqs: int) -> dict[str, Any]:
    """One size in this process: warm up, then the whole workload; tokens/s over the generation."""
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

    t0 = time.monotonic()
    llm = LLM(model_dir, dtype=dtype, tensor_parallel_size=tp, max_num_seqs=max_num_seqs, kv_cache_memory=(1 << 30) // tp)
    load_s = time.monotonic() - t0
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate([Request("warm", prompt_token_ids=work[0], params=SamplingParams(max_tokens=4, ignore_eos=True))])
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=params) for i, p in enumerate(work)]
    t0 = time.monotonic()
    out = llm.generate(reqs)
    secs = time.monotonic() - t0
    llm.close()
    tokens = sum(len(c.token_ids) for c in out)
    return {"tp": tp, "load_s": round(load_s, 1), "seconds": round(secs, 2), "output_tokens": tokens,
            "tokens_per_s": round(tokens / secs, 1), "steps": llm.stats["steps"], "token_ids": [c.token_ids for c in out]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", default="32,256", help="min,max prompt tokens")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tag", default="tp_throughput")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        res = run_one(a.model_dir, int(a.tp), json.loads(Path(a.work).read_text()), a.max_tokens, a.dtype, a.max_num_seqs)
        print("RESULT " + json.dumps(res), flush=True)
        return 0
    rng = random.Random(a.seed)
    lo, hi = (int(x) for x in a.prompt_len.split(","))
    work = [[rng.randrange(20, SHAPE["vocab_size"]) for _ in range(rng.randint(lo, hi))] for _ in range(a.num_prompts)]
    tmp = Path(tempfile.mkdtemp(prefix="sluice-tp-bench-"))
    model_dir = make_model(tmp / "model", a.seed)
    (tmp / "work.json").write_text(json.dumps(work))
    results = []
    for tp in [int(x) for x in a.tp.split(",")]:
        cmd = [sys.executable, __file__, "--child", "--tp", str(tp), "--model-dir", str(model_dir), "--work",
               str(tmp / "work.json"), "--max-tokens", str(a.max_tokens), "--dtype", a.dtype,
               "--max-num-seqs", str(a.max_num_seqs)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        load = os.getloadavg()[0]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(f"TP={tp} failed:\n{proc.stderr[-3000:]}")
            return 1
        res = json.loads(line.removeprefix("RESULT "))
        res["load_before"] = round(load, 1)
        results.append(res)
    base = results[0]
    agree = all(r["token_ids"] == base["token_ids"] for r in results)
    print(f"{a.num_prompts} prompts of {lo}-{hi} tokens x {a.max_tokens} tokens, {a.dtype}, {os.cpu_count()} cores; "
          f"greedy tokens {'identical' if agree else 'DIFFERENT'} across sizes")
    print("| TP | output tok/s | generation s | steps | load s | load avg before |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['tp']} | {r['tokens_per_s']} | {r['seconds']} | {r['steps']} | {r['load_s']} | {r['load_before']} |")
    out = HERE / "out"
    out.mkdir(exist_ok=True)
    for r in results:
        r.pop("token_ids")
    (out / f"{a.tag}.json").write_text(json.dumps({"args": vars(a), "identical": agree, "results": results}, indent=1))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
