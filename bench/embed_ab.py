"""Embedding engine settings A/B in one process: one EmbeddingEngine per setting, on the same passages as
bench/embed_throughput.py, timed in interleaved rounds so that load that comes and goes hits every
setting alike. Reports the median wall tokens/s and tokens per CPU-second (this process, all threads).

    PYTHONPATH=$PWD python bench/embed_ab.py                                # attention and token budget
    PYTHONPATH=$PWD python bench/embed_ab.py --threads 1 --num-passages 500 --rounds 3

A setting is NAME=key:value,key:value over EmbeddingConfig's fields (ints as ints), e.g.
``--setting sdpa-2048=cpu_attention:sdpa,max_num_batched_tokens:2048``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import embed_throughput  # noqa: E402  (this directory, not a package)

DEFAULT_SETTINGS = ["sdpa-2048=cpu_attention:sdpa,max_num_batched_tokens:2048",
                    "varlen-2048=cpu_attention:varlen,max_num_batched_tokens:2048",
                    "varlen-4096=cpu_attention:varlen,max_num_batched_tokens:4096"]


def parse_setting(text: str) -> tuple[str, dict[str, Any]]:
    name, _, body = text.partition("=")
    config: dict[str, Any] = {}
    for part in filter(None, body.split(",")):
        key, _, value = part.partition(":")
        config[key] = int(value) if value.isdigit() else value
    return name, config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-passages", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as torch starts)")
    ap.add_argument("--setting", action="append", help="NAME=key:value,... (repeatable; default: " +
                    " ".join(DEFAULT_SETTINGS) + ")")
    args = ap.parse_args()
    from sluice.engine.omp_spin import short_omp_spin

    short_omp_spin()  # before torch loads, as the CLI does for an embedding model
    import torch
    from sluice.engine.embedding_engine import EmbeddingEngine, EmbeddingRequest

    if args.threads:
        torch.set_num_threads(args.threads)
    texts = embed_throughput.passages(args.num_passages)
    settings = dict(parse_setting(s) for s in args.setting or DEFAULT_SETTINGS)
    engines = {name: EmbeddingEngine(embed_throughput.MODEL, **config) for name, config in settings.items()}
    for eng in engines.values():
        eng.embed([EmbeddingRequest(f"w{i}", t) for i, t in enumerate(texts[: embed_throughput.WARMUP])])
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    tokens = 0
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for name, eng in engines.items():
            c0, t0 = time.process_time(), time.perf_counter()
            outs = eng.embed([EmbeddingRequest(str(i), t) for i, t in enumerate(texts)])
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            tokens = sum(o.prompt_tokens for o in outs)
            rates[name].append((tokens / wall, tokens / cpu))
    print(f"{len(texts)} passages, {tokens} tokens, {args.rounds} interleaved rounds, {torch.get_num_threads()} "
          f"threads, load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print("| setting | wall tokens/s (median) | tokens per CPU-second (median) | every round's wall tokens/s |\n"
          "| --- | ---: | ---: | --- |")
    for name, r in rates.items():
        print(f"| {name} | {statistics.median(x[0] for x in r):.0f} | {statistics.median(x[1] for x in r):.0f} "
              f"| {', '.join(f'{x[0]:.0f}' for x in r)} |")


if __name__ == "__main__":
    main()
