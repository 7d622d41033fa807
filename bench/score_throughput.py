"""Scoring throughput: prompt log-probabilities of completions lines (``echo: true, logprobs: 1,
max_tokens: 0``, what lm-evaluation-harness's local-completions sends), Sluice against a transformers
forward pass in batches. Tokens scored per second (every prompt token but the first).

    python bench/score_throughput.py                        # 1,000 lines, the default model, float32
    python bench/score_throughput.py --num-lines 64 --tag quick
    python bench/score_throughput.py --dtype bfloat16 --batch-size 8,16,32,64   # transformers' best of four

Each system runs in a fresh process of its own (this file with ``--child``) on the same lines, after a
short warm-up of its own. Sluice takes the whole path a line takes in ``sluice generate``: parse the line,
run the engine, shape the OpenAI output line. transformers runs the same dense weights in the same dtype
(``--hf-weights gguf`` gives its own GGUF loading instead: packed weights, float32 compute), gets the token
ids ready-made, sorted by length into batches of ``--batch-size`` (right-padded, masked; SDPA attention,
the model's default, recorded in the JSON), one forward each, log_softmax and the top-1 per position: the
way one would write it by hand.
Several batch sizes run one after another in its process, and its row is the fastest. Both report their
first lines' logprobs, and the report states their max abs difference.

A third child measures the ``ceiling``: the model's GEMMs alone (one decoder layer's linear layers, times
the layer count, and the 576 x 49,152 head for SmolLM2), on random weights in the same dtype, at
``CEILING_ROWS`` rows, each GEMM by the fastest of the CPU paths Sluice can pick (engine/linear.py), best
of ``CEILING_REPEATS``. Scoring a token needs at least those FLOPs (the head too: the logprob's normaliser
is over the whole vocabulary), so no system scores faster than that row; the note says what share of it
each system reaches. Writes bench/out/score-TAG.json and .md; each child's log goes to bench/out/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PROMPTS = ROOT.parent / "shared" / "data" / "prompts"
OUT = HERE / "out"
CHECKED = 8  # lines whose logprobs both systems report, to compare
CEILING_ROWS = (256, 1024)  # GEMM rows timed for the ceiling (Sluice's logits chunk; a step's share)
CEILING_REPEATS = 5


def load_texts(n: int) -> list[str]:
    rows: list[str] = []
    for name in ("vicuna_bench.jsonl", "mt_bench.jsonl"):
        f = PROMPTS / name
        if not f.exists():
            raise SystemExit(f"{f} not found: the benchmark reads the shared prompt sets beside the project")
        for x in f.read_text().splitlines():
            if x.strip():
                rows.extend(json.loads(x)["turns"])
    # Distinct lines: a numbered prefix keeps repeats from being one cached prompt.
    return [f"{i}. {rows[i % len(rows)]}" for i in range(n)]


def score_lines(texts: list[str]) -> list[str]:
    return [json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/completions",
                        "body": {"prompt": t, "echo": True, "logprobs": 1, "max_tokens": 0}})
            for i, t in enumerate(texts)]


# ---- the children ---------------------------------------------------------------------------------
def run_sluice(args: argparse.Namespace, lines: list[str]) -> dict[str, Any]:
    from sluice.engine.llm import LLM
    from sluice.jobs.lines import parse_line
    from sluice.jobs.openai_output import result_to_output_line
    from sluice.worker.convert import completion_to_result, job_to_request

    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
              kv_cache_memory=args.kv_cache_memory)
    warm = [parse_line(x, i + 1) for i, x in enumerate(score_lines(["warm up, please"] * 2))]
    llm.generate([job_to_request(j, request_id=f"w{i}") for i, j in enumerate(warm)])
    t0 = time.perf_counter()
    jobs = [parse_line(x, i + 1) for i, x in enumerate(lines)]
    by_id = {j.custom_id: j for j in jobs}
    outs = [result_to_output_line(by_id[c.request_id], completion_to_result(by_id[c.request_id], c, llm.tokenizer))
            for c in llm.generate([job_to_request(j) for j in jobs])]
    seconds = time.perf_counter() - t0
    bodies = [o["response"]["body"] for o in outs]
    scored = sum(b["usage"]["prompt_tokens"] - 1 for b in bodies)
    first = [b["choices"][0]["logprobs"]["token_logprobs"] for b in bodies[:CHECKED]]
    return {"tokens": scored, "seconds": seconds, "first": first, "dtype": str(llm.dtype), "stats": llm.stats}


def run_hf(args: argparse.Namespace, lines: list[str]) -> dict[str, Any]:
    import torch
    from sluice.engine.loader import DEFAULT_MODEL, dense_path, resolve_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(args.model or DEFAULT_MODEL)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "auto": torch.float32}[args.dtype]
    if args.hf_weights == "dense" or src.gguf_file is None:
        # The dense weights Sluice runs (a GGUF checkpoint dequantized once), in the asked dtype.
        tok = AutoTokenizer.from_pretrained(dense_path(src))
        model = AutoModelForCausalLM.from_pretrained(dense_path(src), dtype=dtype).eval()
    else:
        # transformers' own GGUF path: it keeps the weights packed and computes in float32 whatever the dtype.
        tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=dtype).eval()
    texts = [json.loads(x)["body"]["prompt"] for x in lines]
    ids = [tok.encode(t) for t in texts]
    score_batch(model, [tok.encode("warm up, please")] * 2)
    runs = {b: hf_pass(model, ids, b) for b in batch_sizes(args.batch_size)}
    best = min(runs, key=lambda b: runs[b][0])
    seconds, results = runs[best]
    return {"tokens": sum(len(x) - 1 for x in ids), "seconds": seconds, "dtype": str(dtype), "batch_size": best,
            "seconds_by_batch_size": {b: r[0] for b, r in runs.items()},
            "attention": model.config._attn_implementation, "weights": args.hf_weights,
            "first": [[None, *results[i]] for i in range(min(CHECKED, len(ids)))]}


def batch_sizes(spec: str) -> list[int]:
    return [int(x) for x in spec.split(",")]


def hf_pass(model: Any, ids: list[list[int]], batch_size: int) -> tuple[float, dict[int, list[float]]]:
    """Score every prompt in batches of ``batch_size``, sorted by length; (seconds, logprobs by line)."""
    t0 = time.perf_counter()
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    results: dict[int, list[float]] = {}
    for lo in range(0, len(order), batch_size):
        part = order[lo:lo + batch_size]
        for i, lps in zip(part, score_batch(model, [ids[i] for i in part]), strict=True):
            results[i] = lps
    return time.perf_counter() - t0, results


def run_ceiling(args: argparse.Namespace, lines: list[str]) -> dict[str, Any]:
    """Tokens per second of the model's GEMMs alone: per GEMM the fastest CPU path (engine/linear.py)."""
    import torch
    from sluice.engine.linear import candidates, model_gemm_shapes, time_gemms
    from sluice.engine.loader import load_config

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    shapes = model_gemm_shapes(load_config(args.model))
    impls = candidates(dtype)
    best: dict[str, Any] = {}
    for rows in CEILING_ROWS:
        seconds = time_gemms(shapes.all, impls, dtype, rows, CEILING_REPEATS, max_elements=None)
        fastest = {shape: min(seconds[i][shape] for i in impls) for shape in shapes.all}
        step = shapes.step_seconds(fastest)
        if not best or rows / step > best["tokens"] / best["seconds"]:
            best = {"tokens": rows, "seconds": step, "rows": rows}
    flops = 2 * (shapes.num_layers * sum(k * n for k, n in shapes.layer) + shapes.head[0] * shapes.head[1])
    return {**best, "dtype": str(dtype), "impls": impls, "gflop_per_token": flops / 1e9, "first": []}


def score_batch(model: Any, batch: list[list[int]]) -> list[list[float]]:
    """Each prompt's token logprobs after its first (and the top-1 there, computed as a scorer would)."""
    import torch

    width = max(len(x) for x in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for r, x in enumerate(batch):
        input_ids[r, :len(x)] = torch.tensor(x)
        mask[r, :len(x)] = 1
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(input_ids=input_ids, attention_mask=mask).logits.float(), dim=-1)
        chosen = logprobs[:, :-1].gather(2, input_ids[:, 1:, None])[..., 0]
        logprobs[:, :-1].topk(1, dim=-1)  # the top-1 alternative, as echo + logprobs 1 returns it
    return [chosen[r, :len(x) - 1].tolist() for r, x in enumerate(batch)]


# ---- the parent -----------------------------------------------------------------------------------
def child(system: str, args: argparse.Namespace, lines_file: Path, out_file: Path) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", system, "--lines-file", str(lines_file), "--result", str(out_file),
           "--dtype", args.dtype, "--batch-size", args.batch_size,
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--hf-weights", args.hf_weights]
    if args.model:
        cmd += ["--model", args.model]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", str(args.kv_cache_memory)]
    log = OUT / "logs" / f"score-{args.tag}-{system}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    if rc != 0:
        return {"error": f"exit {rc}, see {log}"}
    return json.loads(out_file.read_text())


def max_diff(a: list[list[float | None]], b: list[list[float | None]]) -> float:
    return max((abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)
                if x is not None and y is not None), default=0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-lines", type=int, default=1000)
    p.add_argument("--model", default=None, help="Default: the default model (SmolLM2-135M-Instruct).")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-size", default="16",
                   help="transformers' batch size, or several (8,16,32): each runs, the fastest is its row.")
    p.add_argument("--max-num-batched-tokens", type=int, default=4096, help="Sluice's step budget.")
    p.add_argument("--kv-cache-memory", type=int, default=None)
    p.add_argument("--tag", default="score")
    p.add_argument("--hf-weights", default="dense", choices=["dense", "gguf"],
                   help="transformers' weights: dense (what Sluice runs; default) or, for a GGUF model, transformers' "
                        "own GGUF loading, which keeps them packed and computes in float32 whatever --dtype says.")
    p.add_argument("--no-ceiling", action="store_true", help="Skip the GEMM-only ceiling row.")
    p.add_argument("--child", choices=["sluice", "hf", "ceiling"], help=argparse.SUPPRESS)
    p.add_argument("--lines-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        lines = args.lines_file.read_text().splitlines()
        res = {"sluice": run_sluice, "hf": run_hf, "ceiling": run_ceiling}[args.child](args, lines)
        args.result.write_text(json.dumps(res))
        return

    OUT.mkdir(parents=True, exist_ok=True)
    lines_file = OUT / f"score-{args.tag}-lines.jsonl"
    lines_file.write_text("\n".join(score_lines(load_texts(args.num_lines))) + "\n")
    systems = ("hf", "sluice") if args.no_ceiling else ("hf", "sluice", "ceiling")
    res = {s: child(s, args, lines_file, OUT / f"score-{args.tag}-{s}.json") for s in systems}
    rows = []
    for s, r in res.items():
        if "error" in r:
            rows.append(f"| {s} | failed: {r['error']} | | |")
        else:
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
            rows.append(f"| {s} | {r['tokens']} | {r['seconds']:.3g} | {r['tokens_per_s']:.0f} |")
    ok = all("error" not in res[s] for s in ("hf", "sluice"))
    ratio = res["sluice"]["tokens_per_s"] / res["hf"]["tokens_per_s"] if ok else None
    diff = max_diff(res["sluice"]["first"], res["hf"]["first"]) if ok else None
    note = (f"\n{args.num_lines} lines, {args.dtype}, transformers ({args.hf_weights} weights, "
            f"{res['hf']['attention']} attention) batches of {res['hf']['batch_size']} (of "
            f"{args.batch_size}); Sluice / transformers = {ratio:.2f}x; max abs logprob difference on the first "
            f"{CHECKED} lines: {diff:.2e}\n" if ok else "\n")
    c = res.get("ceiling", {})
    if ok and "tokens_per_s" in c:
        top = c["tokens_per_s"]
        note += (f"ceiling: the GEMMs alone ({c['gflop_per_token']:.3f} GFLOP/token, {c['rows']} rows, fastest of "
                 f"{', '.join(c['impls'])}) {top:.0f} tokens/s; transformers reaches {res['hf']['tokens_per_s'] / top:.0%} "
                 f"of it, Sluice {res['sluice']['tokens_per_s'] / top:.0%}; ceiling / transformers = "
                 f"{top / res['hf']['tokens_per_s']:.2f}x\n")
    table = "| system | tokens scored | seconds | tokens/s |\n|---|---|---|---|\n" + "\n".join(rows) + "\n" + note
    (OUT / f"score-{args.tag}.json").write_text(json.dumps({"args": vars(args) | {"lines_file": str(lines_file)},
                                                            "results": res, "ratio": ratio, "max_abs_diff": diff},
                                                           default=str, indent=1))
    (OUT / f"score-{args.tag}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
