"""The ``sluice`` command.

\b
Exit codes:
  0    success
  1    a user error: bad file, unknown batch id, unknown model, bad option value (one line, no traceback)
  2    click's own usage errors (unknown option, missing argument)
  3    some requests failed or input lines were bad (their error lines are in the errors file)
  4    the job server (SLUICE_REDIS_URL, or the embedded one of SLUICE_HOME) is unreachable
  130  interrupted (Ctrl-C); a batch being waited on or followed runs on

\b
Environment: SLUICE_HOME (the embedded job server's data and the API's files), SLUICE_REDIS_URL (an
external Redis instead), SLUICE_API_KEY (bearer token `serve` and `up` require on /v1).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import click

from cli.common import EXIT_SOME_FAILED, EXIT_USER_ERROR, UserError, one_line  # noqa: F401 - re-exported
from cli.options import engine_kwargs, engine_options, parse_bytes, with_engine_options  # noqa: F401
from cli.queue_cmds import batches_cmd, cancel_cmd, results_cmd, status_cmd, submit_cmd
from cli.serve_cmds import serve_cmd, up_cmd, worker_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=__doc__.split("\n\n", 1)[1])
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does.")
def cli(verbose: bool) -> None:
    """Sluice: bulk LLM generation over Redis streams and a continuous batcher."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@cli.command()
@click.argument("input_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", "output_file", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Results, one OpenAI batch output line per request, written as each finishes.")
@click.option("--errors", "errors_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Failed requests and bad lines [default: OUTPUT with .errors before its suffix].")
@with_engine_options
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Default max_tokens for lines that set none.")
@click.option("--temperature", type=click.FloatRange(min=0), default=None, help="Default temperature (0 = greedy).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None, help="Default top_p.")
@click.option("--seed", type=int, default=None, help="Default seed.")
@click.option("--resume", is_flag=True, help="Keep OUTPUT and skip the custom_ids already in it.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def generate(input_file: Path, output_file: Path, errors_file: Path | None, model: str | None, dtype: str, max_num_seqs: int,
             max_num_batched_tokens: int, kv_cache_memory: str | None, policy: str, enforce_eager: bool,
             max_tokens: int | None,
             temperature: float | None, top_p: float | None, seed: int | None, resume: bool, no_progress: bool) -> None:
    """Run INPUT_FILE (JSONL) through the engine in-process, no queue: results to OUTPUT, failures to ERRORS.

    Lines are OpenAI batch lines ({"custom_id", "method", "url", "body"}) or simple lines
    ({"prompt": ...} or {"messages": [...]}, plus sampling fields such as max_tokens).
    """
    from cli.output import default_errors_path
    from jobs.schemas import SamplingParams
    from worker.local import generate_file

    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed}
    defaults = SamplingParams(**{k: v for k, v in given.items() if v is not None})
    kwargs = engine_kwargs(dtype, max_num_seqs, max_num_batched_tokens, kv_cache_memory, policy, enforce_eager)
    t0 = time.time()
    try:
        s = generate_file(input_file, output_file, errors_file or default_errors_path(output_file), model=model,
                          engine_kwargs=kwargs, defaults=defaults, resume=resume, progress=not no_progress)
    except (OSError, ValueError) as e:
        raise UserError(one_line(e)) from None
    dt = time.time() - t0
    click.echo(f"{s.completed} completed, {s.failed} failed, {s.bad_lines} bad lines, {s.skipped} skipped "
               f"(already in output); {s.completion_tokens} tokens in {dt:.1f}s -> {output_file}", err=True)
    if s.failed or s.bad_lines:
        sys.exit(EXIT_SOME_FAILED)


for command in (submit_cmd, status_cmd, results_cmd, cancel_cmd, batches_cmd, worker_cmd, serve_cmd, up_cmd):
    cli.add_command(command)


if __name__ == "__main__":
    cli()
