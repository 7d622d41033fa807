"""The ``sluice`` command.

\b
Exit codes:
  0    success
  1    a user error: bad file, unknown batch id, unknown model, a bad SLUICE_* value (one line, no traceback)
  2    a usage error: unknown option, missing argument, bad option value (a size, a duration, a choice)
  3    some requests failed or input lines were bad (their error lines are in the errors file)
  4    the job server (SLUICE_REDIS_URL, or the embedded one of SLUICE_HOME) is unreachable or not running
  130  interrupted (Ctrl-C); a batch being waited on or followed runs on

\b
Environment: SLUICE_HOME (the embedded job server's data and the API's files), SLUICE_REDIS_URL (an
external Redis instead), SLUICE_API_KEY (bearer token `serve` and `up` require on /v1); options marked
[env var: ...] read that variable when the flag is not given. A command that needs the job server
starts the embedded one if it is not running, says so in one line and leaves it running for later
commands: `sluice server status|stop`.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import click

from cli.common import EXIT_SOME_FAILED, EXIT_USER_ERROR, UserError, need_engine, one_line  # noqa: F401 - re-exported
from cli.job_server_cmds import server_cmd
from cli.options import engine_kwargs, sampling_defaults, with_engine_options, with_sampling_options
from cli.output import STDIO, default_errors_path
from cli.queue_cmds import batches_cmd, cancel_cmd, readable_input, results_cmd, status_cmd, submit_cmd
from cli.run_cmds import serve_cmd, up_cmd, worker_cmd
from jobs.settings import SettingsError


class SluiceGroup(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except SettingsError as e:  # a SLUICE_* variable read deep inside a command
            raise UserError(str(e)) from None


@click.group(cls=SluiceGroup, context_settings={"help_option_names": ["-h", "--help"]},
             epilog=__doc__.split("\n\n", 1)[1])
@click.version_option(package_name="sluice-llm", prog_name="sluice")
@click.option("-v", "--verbose", is_flag=True, help="Log what the engine does.")
def cli(verbose: bool) -> None:
    """Sluice: bulk LLM generation over Redis streams and a continuous batcher."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


@cli.command()
@click.argument("input_file", type=click.Path(exists=True, dir_okay=False, allow_dash=True, path_type=Path))
@click.option("-o", "--output", "output_file", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              required=True, help="Results, one OpenAI batch output line per request, written as each finishes "
              "(- for stdout).")
@click.option("--errors", "errors_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Failed requests and bad lines [default: OUTPUT with .errors before its suffix; with -o -, "
              "stdout too].")
@with_engine_options
@with_sampling_options
@click.option("--resume", is_flag=True, help="Keep OUTPUT and skip the custom_ids already in it.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def generate(input_file: Path, output_file: Path, errors_file: Path | None, model: str | None, dtype: str,
             max_num_seqs: int, max_num_batched_tokens: int, kv_cache_memory: int | None, policy: str,
             enforce_eager: bool, model_impl: str, reasoning_parser: str, tensor_parallel_size: int, max_tokens: int | None,
             temperature: float | None, top_p: float | None, seed: int | None, chat_template_kwargs: str | None,
             resume: bool, no_progress: bool) -> None:
    """Run INPUT_FILE (JSONL; - reads stdin) through the engine in-process, no queue: results to OUTPUT,
    failures to ERRORS.

    Lines are OpenAI batch lines ({"custom_id", "method", "url", "body"}) or simple lines
    ({"prompt": ...} or {"messages": [...]}, plus sampling fields such as max_tokens); with an
    embedding model, /v1/embeddings lines and {"input": ...} lines.
    """
    need_engine()
    from worker.generate_file import generate_file

    to_stdout = str(output_file) == STDIO
    if resume and to_stdout:
        raise click.UsageError("--resume needs an OUTPUT file to resume, not stdout")
    # The engine writes through its own file object; on stdout that is the process's own stdout.
    target = Path("/dev/stdout") if to_stdout else output_file
    errors = errors_file or (target if to_stdout else default_errors_path(output_file))
    defaults = sampling_defaults(max_tokens, temperature, top_p, seed, chat_template_kwargs)
    kwargs = engine_kwargs(dtype, max_num_seqs, max_num_batched_tokens, kv_cache_memory, policy, enforce_eager,
                           model_impl, reasoning_parser, tensor_parallel_size)
    t0 = time.time()
    try:
        with readable_input(input_file) as src:
            s = generate_file(src, target, errors, model=model, engine_kwargs=kwargs, defaults=defaults,
                              resume=resume, progress=not no_progress)
    except (OSError, ValueError) as e:
        raise UserError(one_line(e)) from None
    dt = time.time() - t0
    click.echo(f"{s.completed} completed, {s.failed} failed, {s.bad_lines} bad lines, {s.skipped} skipped "
               f"(already in output); {s.completion_tokens} tokens in {dt:.1f}s -> "
               f"{'stdout' if to_stdout else output_file}", err=True)
    if s.failed or s.bad_lines:
        sys.exit(EXIT_SOME_FAILED)


for command in (submit_cmd, status_cmd, results_cmd, cancel_cmd, batches_cmd, worker_cmd, serve_cmd, up_cmd,
                server_cmd):
    cli.add_command(command)


if __name__ == "__main__":
    cli()
