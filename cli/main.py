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
from sluice.cli.common import EXIT_SOME_FAILED, EXIT_USER_ERROR, UserError, need_engine, one_line  # noqa: F401 - re-exported
from sluice.cli.control_cmds import events_cmd, pause_cmd, resume_cmd
from sluice.cli.datasets import (
    InputArg,
    RowFlags,
    UsageLine,
    generate_dataset,
    wants_dataset,
    with_row_options,
)
from sluice.cli.job_control_cmds import job_control_cmds
from sluice.cli.job_server_cmds import server_cmd
from sluice.cli.options import (
    arrival_order_option,
    sampling_defaults,
    with_engine_options,
    with_sampling_options,
)
from sluice.cli.output import STDIO, default_errors_path
from sluice.cli.queue_cmds import batches_cmd, cancel_cmd, readable_input, results_cmd, status_cmd, submit_cmd
from sluice.cli.run_cmds import serve_cmd, up_cmd, worker_cmd
from sluice.jobs.settings import SettingsError


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
@click.argument("input_file", type=InputArg(exists=True))
@click.option("-o", "--output", "output_file", type=click.Path(dir_okay=False, allow_dash=True), required=True,
              help="Results, one OpenAI batch output line per request, written as each finishes (- for stdout); "
              "for a dataset, its rows with result columns (.parquet, .jsonl, .csv; a path or URL).")
@click.option("--errors", "errors_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Failed requests and bad lines [default: OUTPUT with .errors before its suffix; with -o -, "
              "stdout too]. Not for a dataset: its rows' errors are in OUTPUT's error column.")
@with_engine_options
@with_sampling_options
@with_row_options()
@click.option("--resume", is_flag=True, help="Keep OUTPUT and skip the custom_ids (dataset: rows) already in it.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@arrival_order_option
def generate(input_file: str, output_file: str, errors_file: Path | None, model: str | None, engine: dict[str, Any],
             max_tokens: int | None, temperature: float | None, top_p: float | None, seed: int | None,
             chat_template_kwargs: str | None, rows: RowFlags, resume: bool, no_progress: bool,
             arrival_order: bool) -> None:
    """Run INPUT_FILE through the engine in-process, no queue: results to OUTPUT, failures to ERRORS.

    INPUT_FILE is JSONL (- reads stdin): OpenAI batch lines ({"custom_id", "method", "url", "body"}) or
    simple lines ({"prompt": ...} or {"messages": [...]}, plus sampling fields such as max_tokens); with
    an embedding model, /v1/embeddings lines and {"input": ...} lines. Or a dataset: Parquet, CSV, a
    save_to_disk directory, hf://datasets/OWNER/NAME, at a path or any fsspec URL (s3://, file://,
    https://), each row made a request by the row flags; OUTPUT is then its rows with completion,
    finish_reason, usage and error columns added.
    """
    defaults = sampling_defaults(max_tokens, temperature, top_p, seed, chat_template_kwargs)
    if wants_dataset(rows, input_file, output_file):
        _generate_dataset(input_file, output_file, errors_file, model, engine, defaults, rows, resume, no_progress,
                          not arrival_order)
        return
    need_engine(model)
    from sluice.worker.generate_file import generate_file

    to_stdout = output_file == STDIO
    if resume and to_stdout:
        raise click.UsageError("--resume needs an OUTPUT file to resume, not stdout")
    # The engine writes through its own file object; on stdout that is the process's own stdout.
    target = Path("/dev/stdout") if to_stdout else Path(output_file)
    errors = errors_file or (target if to_stdout else default_errors_path(target))
    t0 = time.time()
    try:
        with readable_input(Path(input_file)) as src:
            s = generate_file(src, target, errors, model=model, engine_kwargs=engine, defaults=defaults,
                              resume=resume, progress=not no_progress, plan=not arrival_order)
    except (OSError, ValueError) as e:
        raise UserError(one_line(e)) from None
    dt = time.time() - t0
    click.echo(f"{s.completed} completed, {s.failed} failed, {s.bad_lines} bad lines, {s.skipped} skipped "
               f"(already in output); {s.completion_tokens} tokens in {dt:.1f}s -> "
               f"{'stdout' if to_stdout else output_file}", err=True)
    if s.failed or s.bad_lines:
        sys.exit(EXIT_SOME_FAILED)


def _generate_dataset(input_file: str, output: str, errors_file: Path | None, model: str | None,
                      kwargs: dict[str, Any], defaults: Any, rows: RowFlags, resume: bool, no_progress: bool,
                      plan: bool) -> None:
    if STDIO in (input_file, output):
        raise UsageLine("a dataset is read from and written to a file or URL, not stdin or stdout (-)")
    if errors_file is not None:
        raise UsageLine("--errors is for JSONL lines: a dataset's rows carry their errors in OUTPUT's error column")
    need_engine()
    from sluice.engine.embedding_model import is_embedding_model
    from sluice.engine.factory import build_engine, check_row_model

    try:
        check_row_model(model)
    except ValueError as e:
        raise UserError(str(e)) from None

    def make_engine() -> Any:
        try:
            return build_engine(model, kwargs)
        except (OSError, ValueError) as e:
            raise UserError(one_line(e)) from None

    s = generate_dataset(input_file, output, rows, resume=resume, progress=not no_progress, make_engine=make_engine,
                         defaults=defaults, plan=plan, embed=is_embedding_model(model))
    if s.failed or s.no_result:
        sys.exit(EXIT_SOME_FAILED)


for command in (submit_cmd, status_cmd, results_cmd, cancel_cmd, batches_cmd, worker_cmd, serve_cmd, up_cmd,
                server_cmd, *job_control_cmds, pause_cmd, resume_cmd, events_cmd):
    cli.add_command(command)


if __name__ == "__main__":
    cli()
