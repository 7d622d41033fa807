"""One decoder layer's hooked GEMMs (q/k/v, o, gate/up, down at SmolLM2-135M's shapes) with and without
the CPU LoRA hook (engine/lora/layers.py): the hook's time as a share of the layer's base GEMM time, the
adapters' rows in adapter order (as the model runner lays them out), every target rank ``--rank``.

    python bench/lora_layer_micro.py                      # 4 adapters, 160 rows, torch's thread count
    python bench/lora_layer_micro.py --adapters 16 --threads 1

Base and hooked runs take turns, so a busy machine slows both; still, only a quiet machine's numbers
count (with 2 threads, a loaded machine's OpenMP barriers make every small GEMM pay a time slice).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages: our kernels/ must not hide transformers' kernels

import torch  # noqa: E402
from sluice.engine.lora.adapters import LoraAdapter, LoraWeights  # noqa: E402
from sluice.engine.lora.batch import adapter_runs  # noqa: E402
from sluice.engine.lora.layers import LoraHook, LoraStep  # noqa: E402

HIDDEN, INTER, Q, KV = 576, 1536, 576, 192
MODULES = {"qkv": (HIDDEN, [("q", 0, Q), ("k", Q, KV), ("v", Q + KV, KV)]), "o": (Q, [("o", 0, HIDDEN)]),
           "gate_up": (HIDDEN, [("gate", 0, INTER), ("up", INTER, INTER)]), "down": (INTER, [("down", 0, HIDDEN)])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rows", type=int, default=160, help="the step's packed rows (160: a decode step at batch 160)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = {m: torch.randn(sum(w for _, _, w in parts), k, generator=gen) * 0.02 for m, (k, parts) in MODULES.items()}
    adapters = []
    for i in range(args.adapters):
        modules = {t: LoraWeights(torch.randn(args.rank, k, generator=gen) * 0.02,
                                  torch.randn(w, args.rank, generator=gen) * 0.02, 2.0)
                   for k, parts in MODULES.values() for t, _, w in parts}
        adapters.append(LoraAdapter(f"a{i}", "-", args.rank, modules))
    names = sorted(f"a{i % args.adapters}" for i in range(args.rows))
    runs = adapter_runs(names, [1] * args.rows)
    by_name = {a.name: a for a in adapters}
    step = LoraStep([(by_name[n], a, b) for n, a, b in runs], torch.empty(args.rows * args.rank * 3))
    hooks = {m: LoraHook(parts=list(parts), step=step) for m, (_, parts) in MODULES.items()}
    xs = {m: torch.randn(args.rows, k, generator=gen) for m, (k, _) in MODULES.items()}
    outs = {m: torch.empty(args.rows, w.shape[0]) for m, w in weights.items()}

    def layer(hooked: bool) -> float:
        t = time.perf_counter()
        for m in MODULES:
            torch.mm(xs[m], weights[m].t(), out=outs[m])
            if hooked:
                hooks[m](torch.nn.Identity(), (xs[m],), outs[m])
        return time.perf_counter() - t

    for _ in range(3):
        layer(False), layer(True)
    base, lora = [], []
    for _ in range(args.rounds):
        base.append(layer(False))
        lora.append(layer(True))
    b, h = statistics.median(base), statistics.median(lora)
    print(f"{args.adapters} adapters, {args.rows} rows, rank {args.rank}, {torch.get_num_threads()} threads: "
          f"base GEMMs {b * 1e6:.0f} us/layer, with LoRA {h * 1e6:.0f} us/layer: the hook adds {(h - b) / b:.3f}x")


if __name__ == "__main__":
    main()
