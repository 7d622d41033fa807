"""One system of bench/throughput.py, alone in a fresh process: read the workload, run, write the result.

    python bench/run_system.py SYSTEM WORKLOAD.json RESULT.json --dtype float32 [--max-num-seqs N ...]

SYSTEM: hf-static (transformers, left-padded static batches of 16), hf-generate-batch (transformers'
own continuous batching), sluice-static (``--policy static``, cohorts of 16), sluice (continuous), or
ceiling (tokens/s if a decode step were nothing but the model's matmuls, measured here). One short
warm-up generation runs before the clock starts, as vLLM's start-up does its own. Each system gets
its own process so that nothing one leaves behind (allocator state, thread pools) slows the next.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sluice.engine.loader import load_hf_model, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HF_BATCH = 16  # the static baselines' batch (transformers and Sluice --policy static)


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """The tokens up to and including the first EOS: what a system that stops at EOS returns."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


# ---- transformers ------------------------------------------------------------------------------
def hf_eos(model: Any) -> set[int]:
    ids = model.generation_config.eos_token_id
    return {ids} if isinstance(ids, int) else set(ids or [])


def hf_static(model: Any, tok: Any, pad: int, ids: list[list[int]], max_tokens: int,
              s: dict[str, Any]) -> list[list[int]]:
    """Left-padded batches of HF_BATCH prompts (each sampled ``n`` times: transformers repeats the prompt
    rather than sharing its prefill). transformers cannot seed per request: one seed for the run."""
    eos, outputs = hf_eos(model), []
    if s["seed"] is not None:
        torch.manual_seed(s["seed"])
    sample = s["temperature"] > 0
    kw: dict[str, Any] = {"do_sample": sample, "num_return_sequences": s["n"], "pad_token_id": pad}
    if sample:
        kw.update(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"] or None)
    if s["stop"]:
        kw.update(stop_strings=s["stop"], tokenizer=tok)
    stops = eos | ({pad} if s["stop"] else set())  # a row stopped by a stop string is padded after it
    for i in range(0, len(ids), HF_BATCH):
        chunk = ids[i : i + HF_BATCH]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in chunk])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in chunk])
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=max_tokens, **kw)
        outputs += [until_eos(row[width:].tolist(), stops) for row in out]
    return outputs


def hf_generate_batch(model: Any, ids: list[list[int]], max_tokens: int, s: dict[str, Any]) -> list[list[int]]:
    from transformers import GenerationConfig

    temperature = s["temperature"]
    cfg = GenerationConfig(max_new_tokens=max_tokens, do_sample=temperature > 0, temperature=temperature or None,
                           eos_token_id=sorted(hf_eos(model)))
    with torch.inference_mode():
        out = model.generate_batch(inputs=ids, generation_config=cfg)
    return [until_eos(list(out[k].generated_tokens), hf_eos(model)) for k in sorted(out, key=_request_index)]


def _request_index(request_id: str) -> int:
    return int(request_id.rsplit("_", 1)[-1])


# ---- Sluice ------------------------------------------------------------------------------------
def sluice_generate(llm: Any, ids: list[list[int]], max_tokens: int, s: dict[str, Any]) -> list[list[int]]:
    """Every sample of every request, request by request; a seed per request (seed + its index)."""
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                              n=s["n"], stop=list(s["stop"]), seed=None if s["seed"] is None else s["seed"] + i)

    reqs = [Request(f"b{i}", prompt_token_ids=x, params=params(i)) for i, x in enumerate(ids)]
    return [o.token_ids for c in llm.generate(reqs) for o in c.outputs]


# ---- the ceiling -------------------------------------------------------------------------------
def matmul_ceiling(cfg: Any, dtype: torch.dtype, batch: int = 256, reps: int = 5) -> dict[str, Any]:
    """Tokens/s if a decode step were nothing but the model's matmuls at ``batch`` rows, measured here.
    Each GEMM counts at the faster of F.linear and the implementation the engine picks for ``dtype``
    (engine/linear.py), so a faster engine path raises the ceiling rather than beating a slow yardstick."""
    from sluice.engine import linear

    shapes = linear.model_gemm_shapes(cfg)
    engine_impl = linear.choose(shapes, dtype)[0]
    impls = sorted({"aten", engine_impl})
    seconds = linear.time_gemms(shapes.all, impls, dtype, batch, reps, max_elements=None)
    best = {s: min(impls, key=lambda i: seconds[i][s]) for s in shapes.all}
    step = shapes.step_seconds({s: seconds[best[s]][s] for s in shapes.all})
    flops = 2 * batch * (shapes.num_layers * sum(k * n for k, n in shapes.layer) + shapes.head[0] * shapes.head[1])
    return {"tokens_per_s": batch / step, "gflops": flops / step / 1e9, "batch": batch, "engine_linear": engine_impl,
            "gemm_by": {f"{k}x{n}": best[(k, n)] for k, n in shapes.all}}


# ---- running one system ------------------------------------------------------------------------
Generate = Callable[[list[list[int]], int, dict[str, Any]], list[list[int]]]
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "n": 1, "seed": None, "stop": []}


def sampling(w: dict[str, Any]) -> dict[str, Any]:
    """The workload's sampling settings (a workload written before --workload has a temperature only)."""
    return w.get("sampling") or {**GREEDY, "temperature": w["temperature"], "seed": 0 if w["temperature"] else None}


def prepare(args: argparse.Namespace, w: dict[str, Any]) -> tuple[Generate, dict[str, Any]]:
    """Load the system (not timed); return its generate function and what to report about it."""
    dtype = DTYPES[args.dtype]
    if args.system in ("hf-static", "hf-generate-batch"):
        model = load_hf_model(w["model"], dtype).eval()
        if args.system == "hf-generate-batch":
            return (lambda ids, n, s: hf_generate_batch(model, ids, n, s)), {}
        tok = load_tokenizer(w["model"])
        pad = tok.pad_token_id if tok.pad_token_id is not None else min(hf_eos(model))
        return (lambda ids, n, s: hf_static(model, tok, pad, ids, n, s)), {"batch": HF_BATCH}
    from sluice.engine.llm import LLM

    kw: dict[str, Any] = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
                          "max_num_batched_tokens": args.max_num_batched_tokens,
                          "kv_cache_memory": args.kv_cache_memory}
    if args.model_impl:
        kw["model_impl"] = args.model_impl
    if args.system == "sluice-static":
        kw.update(policy="static", max_num_seqs=HF_BATCH)
    llm = LLM(w["model"], **kw)
    settings = {k: v for k, v in kw.items() if k != "dtype"}
    return (lambda ids, n, s: sluice_generate(llm, ids, n, s)), {"settings": settings, "engine": llm}


def run(args: argparse.Namespace, w: dict[str, Any]) -> dict[str, Any]:
    if args.system == "ceiling":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(w["model_dir"])
        return {"ceiling": matmul_ceiling(cfg, DTYPES[args.dtype])}
    generate, info = prepare(args, w)
    ids = w["prompt_token_ids"]
    generate([ids[0][:8]], 4, sampling(w))  # warm-up, on the run's own sampling path: first-call costs off the clock
    engine = info.pop("engine", None)
    steps0 = engine.num_steps if engine is not None else 0
    t = time.perf_counter()
    outputs = generate(ids, w["max_tokens"], sampling(w))
    secs = time.perf_counter() - t
    tokens = sum(map(len, outputs))
    result = {"seconds": secs, "output_tokens": tokens, "prompts": len(outputs), "tokens_per_s": tokens / secs,
              "outputs": outputs, **info}
    if engine is not None:
        result["stats"] = {**engine.stats, "steps": engine.num_steps - steps0}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("system", choices=["hf-static", "hf-generate-batch", "sluice-static", "sluice", "ceiling"])
    p.add_argument("workload", type=Path)
    p.add_argument("result", type=Path)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="bytes")
    p.add_argument("--model-impl", default=None, help="passed to Sluice's LLM as model_impl")
    args = p.parse_args()
    torch.manual_seed(0)
    w = json.loads(args.workload.read_text())
    result = {"system": args.system, "dtype": args.dtype, "torch": torch.__version__,
              "threads": torch.get_num_threads(), **run(args, w)}
    args.result.write_text(json.dumps(result))
    if "tokens_per_s" in result:
        print(f"{args.system} {args.dtype}: {result['tokens_per_s']:.1f} tok/s ({result['output_tokens']} tokens, "
              f"{result['seconds']:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
