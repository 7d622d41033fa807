"""Decode (or, with ``--query-len``, prompt-chunk) attention alone: the C++ op over ``--layers`` separate caches (so the K/V come from DRAM, as
in a real step), against a plain sum over as many bytes as a bandwidth yardstick, and the step's own
matmuls (SmolLM2-135M's linear layers for as many tokens, through torch/oneDNN) as the matrix units' yardstick.
Each kernel's GFLOP/s counts the two products (scores and values) over the keys each query row sees.

``--kernels gemm,vector`` (the default) times both kernels of this build: the GEMM kernel on the matrix
units (kernels/cpu/paged_attention_gemm.cpp) and the vector one (kernels/cpu/paged_attention.cpp). The
CPU's ISA and whether it has AMX are printed first.

Compare kernel versions in one process, alternating, best of ``--rounds``, and the median over rounds
of each source's time over the first's (on a busy machine the ratio of neighbouring runs says more than
either time), e.g. the current source against one from an older commit:

    git show HEAD~5:kernels/cpu/paged_attention.cpp > /tmp/old.cpp
    python bench/attention_micro.py --sources /tmp/old.cpp,kernels/cpu/paged_attention.cpp

Each source is built under its own op namespace. SmolLM2-135M's shapes by default: 9 query heads over
3 KV heads of 64, the engine's block size (``--block-size``), blocks handed out in random order.
"""

from __future__ import annotations

import argparse
import functools
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
from sluice.engine.config import EngineConfig  # noqa: E402
from sluice.engine.kv_quant import quantize_rows  # noqa: E402
from sluice.kernels.cpu_ops import attention_isa, load_variant, paged_attention  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", default="gemm,vector", help="this build's kernels to time (gemm, vector)")
    ap.add_argument("--sources", default="", help="other versions of kernels/cpu/paged_attention.cpp to time too")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "int8"], default="auto",
                    help="int8: the 8-bit cache (engine/kv_quant.py), rows quantized from the same random values")
    ap.add_argument("--batch", type=int, default=160)
    ap.add_argument("--context", type=int, default=250)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    ap.add_argument("--query-len", type=int, default=1, help="query rows per sequence: > 1 times prompt chunks")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, rng = DTYPES[args.dtype], random.Random(args.seed)
    torch.manual_seed(args.seed)
    sources = [Path(s) for s in args.sources.split(",") if s]
    kernels = {name: functools.partial(paged_attention, kernel=name) for name in args.kernels.split(",") if name}
    ops = {**kernels, **{str(s): load_variant(s, f"sluice_micro{i}") for i, s in enumerate(sources)}}
    hq, hkv, dim, block = 9, 3, 64, args.block_size
    width = -(-args.context // block)
    num_blocks = args.batch * width + 8
    caches = []
    for _ in range(args.layers):
        cache = torch.int8 if args.kv_cache_dtype == "int8" else dtype
        k, v = (allocate_kv(num_blocks, block, hkv, dim, cache, torch.device("cpu")) for _ in range(2))
        for c in (k, v):
            c.copy_(quantize_rows(torch.randn(*c.shape[:-1], dim)) if cache == torch.int8 else torch.randn(c.shape))
        caches.append((head_major(k), head_major(v)))
    tables = torch.randperm(num_blocks)[: args.batch * width].view(args.batch, width).int()
    seq_lens = torch.tensor([args.context - rng.randrange(40) for _ in range(args.batch)], dtype=torch.int32)
    q_lens = torch.minimum(seq_lens, torch.tensor(args.query_len, dtype=torch.int32))
    qsl = torch.cat((torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).int()))
    q = torch.randn(int(qsl[-1]), hq, dim).to(dtype)
    out = torch.empty_like(q)
    nbytes = args.layers * int(seq_lens.sum()) * hkv * caches[0][0].shape[-1] * 2 * caches[0][0].element_size()
    yardstick = torch.rand(nbytes // 4)

    def all_layers(op: Any) -> None:
        for k, v in caches:
            op(out, q, k, v, tables, qsl, seq_lens, dim**-0.5, 0, 0.0)

    # Keys each query row sees (a prompt chunk's rows are causal), times 2 products x 2 flops x D x Hq.
    keys = sum(int(n) - int(m) + j + 1 for n, m in zip(seq_lens, q_lens, strict=True) for j in range(int(m)))
    flops = args.layers * keys * 4 * dim * hq
    # The step's matmuls for as many tokens: SmolLM2-135M's q/k/v, o, gate/up and down projections.
    tokens = int(qsl[-1])
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
    xs = {k: torch.randn(tokens, k).to(dtype) for k, _ in shapes}
    ws = [torch.randn(k, n).to(dtype) for k, n in shapes]
    gemm_flops = args.layers * sum(2 * tokens * k * n for k, n in shapes)

    def step_matmuls() -> None:
        for _ in range(args.layers):
            for (k, _), w in zip(shapes, ws, strict=True):
                torch.matmul(xs[k], w)

    def seconds(fn: Any) -> float:
        fn()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    best: dict[str, float] = {}
    ratios: dict[str, list[float]] = {name: [] for name in ops}
    first = next(iter(ops))
    for _ in range(args.rounds):
        this: dict[str, float] = {}
        for name, fn in [*((name, lambda op=op: all_layers(op)) for name, op in ops.items()),
                         ("sum over as many bytes", lambda: yardstick.sum()), ("the step's matmuls", step_matmuls)]:
            this[name] = seconds(fn)
            best[name] = min(best.get(name, float("inf")), this[name])
        for name in ratios:
            ratios[name].append(this[name] / this[first])
    print(f"CPU: {cpu_name()}; AMX: {'yes' if cpu_has_amx() else 'no'}; attention ISA for {args.dtype}: "
          f"{attention_isa(dtype, dim)}; torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")
    print(f"{args.layers} layers, batch {args.batch}, context ~{args.context}, {args.query_len} query rows each, "
          f"{args.dtype}, {args.kv_cache_dtype} cache: {nbytes / 1e9:.2f} GB of K/V, {flops / 1e9:.1f} GFLOP of attention; best of {args.rounds}")
    for name, s in best.items():
        work = gemm_flops if name == "the step's matmuls" else flops
        rate = "" if name.startswith("sum") else f"{work / s / 1e9:7.1f} GFLOP/s"
        print(f"  {s * 1e3:8.1f} ms  {nbytes / s / 1e9:5.1f} GB/s {rate:>16}  {name}")
    for name, rs in list(ratios.items())[1:]:
        print(f"  median time ratio {statistics.median(rs):.3f} (rounds {min(rs):.3f}-{max(rs):.3f}): {name} / {first}")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_has_amx() -> bool:
    """The CPU's own flags (amx_bf16 and amx_tile), whatever the kernels use."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "amx_bf16" in text and "amx_tile" in text


if __name__ == "__main__":
    main()
