"""Where a decode step's time goes: matmuls, attention, sampling, everything else.

Fills the engine with ``--batch`` sequences, runs them until every one is decoding at about
``--context`` tokens, then profiles ``--steps`` decode steps with torch.profiler and prints a table of
milliseconds per step by category. Compare backends or dtypes with the flags, e.g.

    python bench/profile_step.py --batch 160 --context 250 --attention-backend torch   # PyTorch gather path
    python bench/profile_step.py --batch 160 --context 250                              # C++ op
    python bench/profile_step.py --batch 256 --compare-sampling 6    # greedy vs sampled steps, interleaved

``--compare-sampling R`` times R rounds of decode steps on the same running batch, each round one step
per sampling setting (greedy; then the benchmark's sampled workload's T=0.8, top_p 0.95, top_k 50 and
T=0.8 alone, both seeded per sequence, switched on the running sequences), and prints each setting's
median step time against greedy's: a ratio from one process and one batch, so a busy machine skews
every setting alike.

``--prefill`` profiles prompt steps instead: ``--batch`` distinct prompts of ``--prompt-len`` tokens,
the first ``--steps`` steps (each a token budget's worth of prompt chunks), as the long-prompt workload::

    python bench/profile_step.py --prefill --batch 8 --prompt-len 2300 --steps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages: our kernels/ must not hide transformers' kernels
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from sluice.engine.llm import LLM  # noqa: E402
from sluice.engine.outputs import Request  # noqa: E402
from sluice.engine.sampling_params import SamplingParams  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

# Top-level ops and the category their time counts towards; anything else is "other". The GEMMs of
# engine/linear.py's oneDNN paths are mkldnn::_linear_pointwise; the fp32-compute path's casts of the
# input and output (aten::to) stay in "everything else".
CATEGORIES = {
    "aten::linear": "matmuls",
    "mkldnn::_linear_pointwise": "matmuls",
    "aten::addmm": "matmuls",
    "aten::mm": "matmuls",
    "aten::matmul": "matmuls",
    "aten::scaled_dot_product_attention": "attention",
    "aten::index_select": "attention (block gather)",
    "aten::index_copy_": "KV write",
}


def categorize(events: list) -> dict[str, float]:
    """Self-inclusive time of top-level categorized ops; the rest of the step is 'other'."""
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        name = e.name
        if name in ("sluice::paged_attention", "sluice::paged_attention_gemm"):
            totals["attention (C++ op)"] += e.cpu_time_total
        elif name == "sluice::store_kv":
            totals["KV write"] += e.cpu_time_total
        elif name in ("sluice::add_rms_norm", "sluice::rms_norm", "sluice::rotary", "sluice::silu_and_mul"):
            totals["norms, rotary, SiLU (C++ ops)"] += e.cpu_time_total
        elif name in CATEGORIES:
            totals[CATEGORIES[name]] += e.cpu_time_total
        elif name in ("sluice::sample", "aten::argmax", "aten::max", "aten::softmax", "aten::topk", "aten::sort",
                      "sluice::argmax_rows"):
            totals["sampling"] += e.cpu_time_total
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=160)
    ap.add_argument("--context", type=int, default=250, help="context length at which steps are profiled")
    ap.add_argument("--prompt-len", type=int, default=120)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ops", type=int, default=0, help="also print the N ops with the most self time")
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="default: 6, or 1 with --prefill")
    ap.add_argument("--compare-sampling", type=int, default=0, metavar="R",
                    help="instead of profiling: R rounds of greedy vs sampled steps, interleaved")
    ap.add_argument("--prefill", action="store_true", help="profile the first prompt steps instead of decodes")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="the step's token budget")
    ap.add_argument("--adapters", type=int, default=0, metavar="K",
                    help="sequence i on LoRA adapter i mod K (bench/lora_throughput.py's rank-16 adapters)")
    args = ap.parse_args()

    budget: dict = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    adapters = lora_adapters(args.model, args.adapters)
    if adapters:
        budget.update(lora_modules=adapters, max_loras=len(adapters), max_lora_rank=16)
    # Prompt steps need only their prompts' blocks: a small cache starts quicker (touching 6 GiB took minutes
    # on a loaded machine).
    kv_gb = args.kv_cache_gb if args.kv_cache_gb is not None else (1.0 if args.prefill else 6.0)
    llm = LLM(args.model, dtype=args.dtype, attention_backend=args.attention_backend, max_num_seqs=args.batch,
              kv_cache_memory=int(kv_gb * (1 << 30)), **budget)
    rng = random.Random(args.seed)
    vocab = llm.hf_config.vocab_size
    if args.prefill:
        profile_prefill(llm, args, rng, vocab)
        return
    gen = args.context - args.prompt_len + max(args.steps, len(SETTINGS) * args.compare_sampling) + 8
    for i in range(args.batch):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        llm.add_request(Request(f"p{i}", prompt_token_ids=prompt, lora=f"a{i % args.adapters}" if adapters else None,
                                params=SamplingParams(max_tokens=gen, ignore_eos=True)))
    t0 = time.perf_counter()
    while min((s.num_tokens for s in llm.scheduler.running), default=0) < args.context or llm.num_waiting:
        llm.step()
    print(f"warm-up to context {args.context}: {time.perf_counter() - t0:.1f} s, running {llm.num_running}, "
          f"backend {type(llm.runner.backend).__name__}, dtype {llm.dtype}, linear {llm.cpu_linear}, "
          f"threads {torch.get_num_threads()}")
    if args.compare_sampling:
        compare_sampling(llm, args.compare_sampling)
        return
    prof, wall = profiled_steps(llm, args.steps)
    print(f"\ndecode step at batch {args.batch}, context ~{args.context}: {wall * 1e3:.1f} ms "
          f"({args.batch / wall:.0f} tok/s)")
    report(prof, wall, args)


def lora_adapters(model: str | None, count: int) -> dict[str, str]:
    """``count`` of bench/lora_throughput.py's random rank-16 adapters (made there once, reused)."""
    if not count:
        return {}
    import lora_throughput  # bench/lora_throughput.py, beside this file
    from sluice.engine.loader import dense_path, resolve_model

    return lora_throughput.make_adapters(dense_path(resolve_model(model)), lora_throughput.OUT / "lora-adapters",
                                         count, 16)


def profile_prefill(llm: LLM, args: argparse.Namespace, rng: random.Random, vocab: int) -> None:
    """The first ``args.steps`` steps over fresh distinct prompts: prompt chunks only, no decodes yet."""
    for i in range(args.batch):
        prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
        llm.add_request(Request(f"p{i}", prompt_token_ids=prompt, params=SamplingParams(max_tokens=4, ignore_eos=True)))
    llm.step()  # the first step also builds and loads what is built on first use: not profiled
    prof, wall = profiled_steps(llm, args.steps)
    print(f"backend {type(llm.runner.backend).__name__}, dtype {llm.dtype}, linear {llm.cpu_linear}, "
          f"threads {torch.get_num_threads()}, budget {llm.config.max_num_batched_tokens} tokens")
    print(f"\nprompt step ({args.batch} prompts of {args.prompt_len} tokens, steps 2-{args.steps + 1}): "
          f"{wall * 1e3:.1f} ms")
    report(prof, wall, args)


def profiled_steps(llm: LLM, steps: int) -> tuple[profile, float]:
    """``steps`` engine steps under the profiler, and the mean seconds per step."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        wall = (time.perf_counter() - t0) / steps
    return prof, wall


def report(prof: profile, wall: float, args: argparse.Namespace) -> None:
    events = [e for e in prof.events() if e.cpu_parent is None or e.cpu_parent.name.startswith("ProfilerStep")]
    totals = categorize(events)
    step_ms = wall * 1e3
    print("| part | ms / step | share |\n|---|---|---|")
    accounted = 0.0
    for name, us in sorted(totals.items(), key=lambda kv: -kv[1]):
        ms = us / 1e3 / args.steps
        accounted += ms
        print(f"| {name} | {ms:.1f} | {ms / step_ms:.0%} |")
    print(f"| everything else | {step_ms - accounted:.1f} | {(step_ms - accounted) / step_ms:.0%} |")
    if args.ops:
        print("\n| op | calls / step | self ms / step |\n|---|---|---|")
        for a in sorted(prof.key_averages(), key=lambda a: -a.self_cpu_time_total)[: args.ops]:
            print(f"| {a.key} | {a.count / args.steps:.0f} | {a.self_cpu_time_total / 1e3 / args.steps:.1f} |")


SETTINGS = {
    "greedy": {},
    "T=0.8, top_p 0.95, top_k 50, seeded": dict(temperature=0.8, top_p=0.95, top_k=50),
    "T=0.8, seeded": dict(temperature=0.8),
}


def compare_sampling(llm: LLM, rounds: int) -> None:
    """Median decode step per sampling setting, the settings taking turns step by step."""
    base = {s.seq_id: s.params for s in llm.scheduler.running}
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, kw in SETTINGS.items():
            for s in llm.scheduler.running:
                seed = {"seed": s.seq_id} if kw else {}
                s.params = dataclasses.replace(base[s.seq_id], **kw, **seed)
            t0 = time.perf_counter()
            llm.step()
            times[name].append(time.perf_counter() - t0)
    batch = llm.num_running
    greedy = statistics.median(times["greedy"])
    print(f"\ndecode steps at batch {batch}, {rounds} rounds, median ms per step")
    print("| sampling | ms / step | vs greedy |\n|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {greedy / med:.3f}x tok/s |")


if __name__ == "__main__":
    main()
