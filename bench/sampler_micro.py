"""The sampler alone: ``sample()`` on [batch, vocab] float32 logits for greedy and sampled settings, with
the C++ passes (kernels/cpu_fused, as the model runner hands them on CPU) and with PyTorch's.

CPU time of the calling thread on one torch thread by default (``--threads``), median of ``--reps``, so
other work on a shared machine adds little; the logits are random with five clear favourites per row, as
a language model's are peaked, and every row has a 1,000-token context for the penalties.

    python bench/sampler_micro.py                 # batch 256, SmolLM2's vocabulary
    python bench/sampler_micro.py --wall --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages: our kernels/ must not hide transformers' kernels

import torch  # noqa: E402
from sluice.engine.sampler import sample  # noqa: E402
from sluice.engine.sampling_params import SamplingParams  # noqa: E402
from sluice.engine.sequence import Sequence  # noqa: E402

CASES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "T=0.8, top_p 0.95, top_k 50, seeded (the sampled workload)": dict(temperature=0.8, top_p=0.95, top_k=50),
    "T=0.8, seeded": dict(temperature=0.8),
    "T=0.8, top_p 0.95, seeded": dict(temperature=0.8, top_p=0.95),
    "T=0.8, top_k 50, min_p 0.05, unseeded": dict(temperature=0.8, top_k=50, min_p=0.05, seed=None),
    "T=0.8, repetition 1.1, frequency 0.2, seeded": dict(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--wall", action="store_true", help="wall-clock time instead of the thread's CPU time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall else time.thread_time
    from sluice.kernels import cpu_fused

    gen = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(args.batch, args.vocab, generator=gen)
    favourites = torch.randint(0, args.vocab, (args.batch, 5), generator=gen)
    logits.scatter_(1, favourites, torch.tensor([16.0, 15, 14, 13, 12]).expand(args.batch, 5))
    print(f"sample() on [{args.batch}, {args.vocab}], {args.threads} thread(s), "
          f"{'wall' if args.wall else 'thread CPU'} ms, median of {args.reps}")
    print("| setting | C++ passes | PyTorch |\n|---|---|---|")
    for name, kw in CASES.items():
        seqs = []
        for i in range(args.batch):
            params = SamplingParams(**{"seed": i, **kw}) if kw else SamplingParams()
            seqs.append(Sequence(i, f"r{i}", 0, list(range(1000 + i % 7)), 1000, params))
        times: dict[str, list[float]] = {"cpp": [], "torch": []}
        for _ in range(args.reps):  # interleaved
            for impl, kernels in (("cpp", cpu_fused), ("torch", None)):
                x = logits.clone()
                t0 = clock()
                sample(x, seqs, [set()] * args.batch, kernels)
                times[impl].append(clock() - t0)
        print(f"| {name} | {statistics.median(times['cpp']) * 1e3:.1f} | {statistics.median(times['torch']) * 1e3:.1f} |")


if __name__ == "__main__":
    main()
