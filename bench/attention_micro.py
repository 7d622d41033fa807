"""Decode (or, with ``--query-len``, prompt-chunk) attention alone: the C++ op over ``--layers`` separate caches (so the K/V come from DRAM, as
in a real step), against a plain sum over as many bytes as a bandwidth yardstick.

Compare kernel versions in one process, alternating, best of ``--rounds``, and the median over rounds
of each source's time over the first's (on a busy machine the ratio of neighbouring runs says more than
either time), e.g. the current source against one from an older commit:

    git show HEAD~5:kernels/cpu/paged_attention.cpp > /tmp/old.cpp
    python bench/attention_micro.py --sources /tmp/old.cpp,kernels/cpu/paged_attention.cpp

Each source is built under its own op namespace. SmolLM2-135M's shapes by default: 9 query heads over
3 KV heads of 64, blocks of 16 (``--block-size``), blocks handed out in random order.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after site-packages: our kernels/ must not hide transformers' kernels

import torch  # noqa: E402
from sluice.engine.attention import allocate_kv, head_major  # noqa: E402
from sluice.kernels.cpu_ops import load_variant  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sources", default=str(ROOT / "kernels" / "cpu" / "paged_attention.cpp"))
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--batch", type=int, default=160)
    ap.add_argument("--context", type=int, default=250)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--query-len", type=int, default=1, help="query rows per sequence: > 1 times prompt chunks")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, rng = DTYPES[args.dtype], random.Random(args.seed)
    torch.manual_seed(args.seed)
    sources = [Path(s) for s in args.sources.split(",")]
    ops = [load_variant(s, f"sluice_micro{i}") for i, s in enumerate(sources)]
    hq, hkv, dim, block = 9, 3, 64, args.block_size
    width = -(-args.context // block)
    num_blocks = args.batch * width + 8
    caches = []
    for _ in range(args.layers):
        k, v = (allocate_kv(num_blocks, block, hkv, dim, dtype, torch.device("cpu")) for _ in range(2))
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
        caches.append((head_major(k), head_major(v)))
    tables = torch.randperm(num_blocks)[: args.batch * width].view(args.batch, width).int()
    seq_lens = torch.tensor([args.context - rng.randrange(40) for _ in range(args.batch)], dtype=torch.int32)
    q_lens = torch.minimum(seq_lens, torch.tensor(args.query_len, dtype=torch.int32))
    qsl = torch.cat((torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()))
    q = torch.randn(int(qsl[-1]), hq, dim).to(dtype)
    out = torch.empty_like(q)
    nbytes = args.layers * int(seq_lens.sum()) * hkv * dim * 2 * q.element_size()
    yardstick = torch.rand(nbytes // 4)

    def all_layers(op: Any) -> None:
        for k, v in caches:
            op(out, q, k, v, tables, qsl, seq_lens, dim**-0.5, 0, 0.0)

    def seconds(fn: Any) -> float:
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    best: dict[str, float] = {}
    ratios: dict[str, list[float]] = {str(s): [] for s in sources}
    for _ in range(args.rounds):
        this: dict[str, float] = {}
        for name, fn in [*((str(s), lambda op=op: all_layers(op)) for s, op in zip(sources, ops, strict=True)),
                         ("sum over as many bytes", lambda: yardstick.sum())]:
            this[name] = seconds(fn)
            best[name] = min(best.get(name, float("inf")), this[name])
        for s in ratios:
            ratios[s].append(this[s] / this[str(sources[0])])
    print(f"{args.layers} layers, batch {args.batch}, context ~{args.context}, {args.query_len} query rows each, "
          f"{args.dtype}: "
          f"{nbytes / 1e9:.2f} GB of K/V; best of {args.rounds}")
    for name, s in best.items():
        print(f"  {s * 1e3:8.1f} ms  {nbytes / s / 1e9:5.1f} GB/s  {name}")
    for name, rs in list(ratios.items())[1:]:
        print(f"  median time ratio {statistics.median(rs):.3f} (rounds {min(rs):.3f}-{max(rs):.3f}): {name} / {sources[0]}")


if __name__ == "__main__":
    main()
