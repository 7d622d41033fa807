"""Throughput on one machine, one run: transformers vs Sluice on the same model, dtype and prompts.

    python bench/throughput.py                          # float32 and bfloat16, 160 prompts, 256 tokens
    python bench/throughput.py --dtype bfloat16 --num-prompts 32 --max-tokens 64
    python bench/throughput.py --sweep max-num-seqs     # Sluice at max_num_seqs 1, 4, 16, 64, 256

Systems: (a) transformers static batching (left-padded batches of 16), (b) transformers
``generate_batch`` (its own continuous batching), (c) Sluice ``static`` policy (cohorts), (d) Sluice
continuous. All greedy; output tokens are counted up to and including EOS. Also reports achieved
GFLOP/s (2 x parameters x tokens/s) against a matmul ceiling measured here at the model's own shapes.
Writes JSON and a PNG bar chart to bench/out/.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.llm import LLM
from engine.loader import load_hf_model, load_tokenizer
from engine.outputs import Request
from engine.sampling_params import SamplingParams

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts"
OUT = Path(__file__).resolve().parent / "out"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_prompts(n: int) -> list[str]:
    rows = []
    for name in ("vicuna_bench.jsonl", "mt_bench.jsonl"):
        f = PROMPTS / name
        if not f.exists():
            raise SystemExit(f"{f} not found: the benchmark reads the shared prompt sets beside the project")
        rows += [json.loads(x)["turns"][0] for x in f.read_text().splitlines() if x.strip()]
    return (rows * (n // len(rows) + 1))[:n]


def chat_ids(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for p in prompts]


def count_until_eos(tokens: list[int], eos: set[int]) -> int:
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


# ---- the systems -------------------------------------------------------------------------------
def hf_static(model: Any, tokenizer: Any, ids: list[list[int]], max_tokens: int, eos: set[int], batch: int = 16) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    produced = 0
    for i in range(0, len(ids), batch):
        chunk = ids[i : i + batch]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                                 pad_token_id=pad)
        produced += sum(count_until_eos(row[width:].tolist(), eos) for row in out)
    return produced


def hf_generate_batch(model: Any, ids: list[list[int]], max_tokens: int, eos: set[int]) -> int:
    from transformers import GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=sorted(eos))
    with torch.inference_mode():
        out = model.generate_batch(inputs=ids, generation_config=cfg)
    return sum(count_until_eos(o.generated_tokens, eos) for o in out.values())


def sluice(llm: LLM, ids: list[list[int]], max_tokens: int) -> int:
    reqs = [Request(f"b{i}", prompt_token_ids=x, params=SamplingParams(max_tokens=max_tokens)) for i, x in enumerate(ids)]
    return sum(c.usage.completion_tokens for c in llm.generate(reqs))


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - t, tokens


# ---- the ceiling -------------------------------------------------------------------------------
def matmul_ceiling(cfg: Any, dtype: torch.dtype, batch: int = 256, reps: int = 5) -> dict[str, float]:
    """Tokens/s if a decode step were nothing but the model's matmuls at ``batch`` rows, measured here."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    shapes = [(h, qkv), (cfg.num_attention_heads * d, h), (h, 2 * i), (i, h)]
    per_layer = sum(_gemm_seconds(batch, k, n, dtype, reps) for k, n in shapes)
    head = _gemm_seconds(batch, h, cfg.vocab_size, dtype, reps)
    step = per_layer * cfg.num_hidden_layers + head
    flops = 2 * batch * (cfg.num_hidden_layers * sum(k * n for k, n in shapes) + h * cfg.vocab_size)
    return {"tokens_per_s": batch / step, "gflops": flops / step / 1e9}


def _gemm_seconds(m: int, k: int, n: int, dtype: torch.dtype, reps: int) -> float:
    a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    torch.nn.functional.linear(a, w)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        torch.nn.functional.linear(a, w)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# ---- runs ----------------------------------------------------------------------------------------
def run_dtype(args: argparse.Namespace, dtype_name: str, prompts: list[str]) -> dict[str, Any]:
    dtype = DTYPES[dtype_name]
    tok = load_tokenizer(args.model)
    tok.padding_side = "left"
    ids = chat_ids(tok, prompts)
    hf = load_hf_model(args.model, dtype).eval()
    eos = {hf.config.eos_token_id} if isinstance(hf.config.eos_token_id, int) else set(hf.config.eos_token_id)
    n_params = sum(p.numel() for p in hf.parameters())
    ceiling = matmul_ceiling(hf.config, dtype)
    rows: dict[str, dict[str, float]] = {}

    def record(name: str, secs: float, tokens: int, n_prompts: int) -> None:
        tps = tokens / secs
        rows[name] = {"seconds": secs, "output_tokens": tokens, "prompts": n_prompts, "tokens_per_s": tps,
                      "gflops": 2 * n_params * tps / 1e9}
        print(f"  {dtype_name:9s} {name:26s} {tps:8.1f} tok/s  ({tokens} tokens, {n_prompts} prompts, {secs:.1f}s)",
              flush=True)

    systems = set(args.systems.split(","))
    sub = ids[: args.generate_batch_prompts or len(ids)]
    if "hf-static" in systems:
        record("transformers static (16)", *timed(lambda: hf_static(hf, tok, ids, args.max_tokens, eos)), len(ids))
    if "hf-generate-batch" in systems:
        record("transformers generate_batch", *timed(lambda: hf_generate_batch(hf, sub, args.max_tokens, eos)), len(sub))
    hf = None  # free its memory before the engines load
    kw = dict(dtype=dtype_name, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    if "sluice-static" in systems:
        llm = LLM(args.model, policy="static", **{**kw, "max_num_seqs": 16})
        record("sluice static (16)", *timed(lambda: sluice(llm, ids, args.max_tokens)), len(ids))
        del llm
    if "sluice" in systems:
        llm = LLM(args.model, **kw)
        record("sluice continuous", *timed(lambda: sluice(llm, ids, args.max_tokens)), len(ids))
        del llm
    base = max((r["tokens_per_s"] for n, r in rows.items() if n.startswith("transformers")), default=None)
    summary: dict[str, Any] = {"dtype": dtype_name, "parameters": n_params, "ceiling": ceiling, "systems": rows}
    if base and "sluice continuous" in rows:
        best = rows["sluice continuous"]["tokens_per_s"]
        summary["sluice_vs_best_transformers"] = best / base
        summary["sluice_vs_ceiling"] = best / ceiling["tokens_per_s"]
    print(f"  {dtype_name:9s} matmul ceiling {ceiling['tokens_per_s']:.0f} tok/s ({ceiling['gflops']:.0f} GFLOP/s)")
    return summary


def run_sweep(args: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    dtype_name = args.dtype[0]
    points = []
    llm = LLM(args.model, dtype=dtype_name, max_num_batched_tokens=args.max_num_batched_tokens)
    ids = chat_ids(llm.tokenizer, prompts)
    for n in (1, 4, 16, 64, 256):
        llm.scheduler.config.max_num_seqs = n
        secs, tokens = timed(lambda: sluice(llm, ids, args.max_tokens))
        points.append({"max_num_seqs": n, "tokens_per_s": tokens / secs, "ms_per_output_token_per_seq":
                       1000 * secs / tokens * min(n, len(ids))})
        print(f"  max_num_seqs {n:4d}: {tokens / secs:8.1f} tok/s", flush=True)
    return {"dtype": dtype_name, "sweep": points}


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results, strict=True):
        if "sweep" in res:
            xs = [p["max_num_seqs"] for p in res["sweep"]]
            ax.plot(xs, [p["tokens_per_s"] for p in res["sweep"]], marker="o")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("max_num_seqs")
            ax.set_ylabel("output tokens/s")
            twin = ax.twinx()
            twin.plot(xs, [p["ms_per_output_token_per_seq"] for p in res["sweep"]], marker="s", color="tab:red")
            twin.set_ylabel("ms per output token (per sequence)", color="tab:red")
        else:
            names = list(res["systems"])
            ax.barh(names, [res["systems"][n]["tokens_per_s"] for n in names])
            ax.axvline(res["ceiling"]["tokens_per_s"], color="gray", linestyle="--", label="matmul ceiling")
            ax.set_xlabel("output tokens/s")
            ax.legend()
        ax.set_title(res["dtype"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--systems", default="hf-static,hf-generate-batch,sluice-static,sluice")
    p.add_argument("--generate-batch-prompts", type=int, default=None,
                   help="run generate_batch on only the first N prompts (it is slow on CPU); reported as such")
    p.add_argument("--sweep", choices=["max-num-seqs"], default=None)
    p.add_argument("--tag", default="throughput")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    prompts = load_prompts(args.num_prompts)
    print(f"{len(prompts)} prompts, max_tokens {args.max_tokens}, greedy, {torch.get_num_threads()} threads", flush=True)
    if args.sweep:
        results = [run_sweep(args, prompts)]
    else:
        results = [run_dtype(args, d, prompts) for d in args.dtype]
    OUT.mkdir(exist_ok=True)
    (OUT / f"{args.tag}.json").write_text(json.dumps(results, indent=2))
    plot(results, OUT / f"{args.tag}.png")
    for r in results:
        if "sluice_vs_best_transformers" in r:
            print(f"{r['dtype']}: sluice continuous = {r['sluice_vs_best_transformers']:.2f}x the faster transformers "
                  f"baseline, {100 * r['sluice_vs_ceiling']:.0f}% of the matmul ceiling")
    print(f"wrote {OUT / (args.tag + '.json')} and .png")


if __name__ == "__main__":
    main()
