"""Commands on the job queue: submit, status, results, cancel, batches. They talk to the job server
(SLUICE_REDIS_URL, or the embedded one of SLUICE_HOME) through ``jobs``."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import click
import redis
from sluice.cli.common import (
    EXIT_SOME_FAILED,
    UserError,
    interrupted,
    job_server_errors,
    one_line,
    open_server,
    require_batch,
)
from sluice.cli.dataset_queue import results_dataset, submit_dataset
from sluice.cli.datasets import InputArg, RowFlags, UsageLine, wants_dataset, with_row_options
from sluice.cli.options import DURATION, sampling_defaults, with_sampling_options
from sluice.cli.output import STDIO, ResultFiles, default_errors_path, default_output_path, echo_line
from sluice.cli.progress import rates, status_text
from sluice.jobs import keys
from sluice.jobs.lines import first_model
from sluice.jobs.schemas import Batch, SamplingParams
from sluice.jobs.settings import MAX_DELIVERIES_KEY, MAX_MAX_DELIVERIES
from sluice.jobs.store import (
    cancel_batch,
    get_batch,
    get_line_errors,
    iter_results,
    page_batches,
    recent_results,
    served_queues,
)
from sluice.jobs.submit import UnknownModel, resolve_model, submit
from tqdm import tqdm

json_option = click.option("--json", "as_json", is_flag=True,
                           help="Print the batch object in OpenAI's shape, one JSON object per line.")


def _print_json(obj: Any) -> None:
    """One object per line (JSON Lines), so a stream of them (--watch) reads with `jq` or line by line."""
    click.echo(json.dumps(obj, separators=(",", ":")))


@contextmanager
def readable_input(path: Path) -> Iterator[Path]:
    """``path``, or for ``-`` a temporary copy of stdin (the file is read more than once), removed after."""
    if str(path) != STDIO:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="sluice-stdin-") as d:
        copy = Path(d) / "stdin.jsonl"
        with copy.open("wb") as f:
            shutil.copyfileobj(click.get_binary_stream("stdin"), f)  # type: ignore[operator]  # click 8.5: object
        yield copy


# ---- submit --------------------------------------------------------------------------------------
@click.command("submit")
@click.argument("input_file", type=InputArg(exists=False))
@click.option("--model", default=None, help="Model (queue) to run on. Default: the first line's model, else "
              "the one model live workers serve, else 'default'.")
@click.option("--wait", is_flag=True, help="Wait with a progress bar, writing results to OUTPUT as they land.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="With --wait: completed requests' lines, - for stdout [default: INPUT_FILE's name with "
              ".results; stdout when INPUT_FILE is -]; for a dataset, its rows with result columns.")
@click.option("--errors", "errors_file", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              default=None, help="With --wait: bad input lines and failed requests [default: OUTPUT with .errors; "
              "with OUTPUT -, stdout too].")
@with_sampling_options
@with_row_options()
@click.option("--priority", type=int, default=0, show_default=True, help="Higher runs first.")
@click.option("--completion-window", type=DURATION, default="24h", show_default=True,
              help="Expire what has not run by then (24h, 90m, 30s, 7d).")
@click.option("--max-deliveries", type=click.IntRange(1, MAX_MAX_DELIVERIES), default=None,
              help=f"Deliveries of each of this batch's jobs before it is dead-lettered [default: the worker's "
              f"--max-deliveries]; stored as metadata {MAX_DELIVERIES_KEY}.")
@json_option
@job_server_errors
def submit_cmd(input_file: str, model: str | None, wait: bool, output: str | None, errors_file: Path | None,
               max_tokens: int | None, temperature: float | None, top_p: float | None, seed: int | None,
               chat_template_kwargs: str | None, rows: RowFlags, priority: int, completion_window: float,
               max_deliveries: int | None, as_json: bool) -> None:
    """Queue INPUT_FILE (JSONL: OpenAI batch lines or simple {"prompt"|"messages", ...} lines; - reads
    stdin) and print the batch id. Bad lines are reported with their line numbers and the rest runs.

    Or a dataset (Parquet, CSV, a save_to_disk directory, hf://datasets/..., at a path or any fsspec
    URL), each row made a request by the row flags; `sluice results BATCH -o OUT.parquet` (or --wait)
    writes its rows with result columns added.
    """
    defaults = sampling_defaults(max_tokens, temperature, top_p, seed, chat_template_kwargs)
    metadata = {MAX_DELIVERIES_KEY: str(max_deliveries)} if max_deliveries is not None else None
    if wants_dataset(rows, input_file, output if wait else None):
        if errors_file is not None:
            raise UsageLine("--errors is for JSONL lines: a dataset's rows carry their errors in OUTPUT's error "
                            "column")
        r = open_server()
        submit_dataset(r, input_file, rows, _queue(r, model), defaults, priority, completion_window, wait=wait,
                       output=output, as_json=as_json, metadata=metadata)
        return
    input_path, output_path = Path(input_file), Path(output) if output is not None else None
    if wait and output_path is None and input_file == STDIO:
        output_path = Path(STDIO)
    if wait and as_json and str(output_path) == STDIO:
        raise click.UsageError("--json and results on stdout (-o -) would share stdout; give -o a file")
    with readable_input(input_path) as path:
        named = _first_model(path)
        r = open_server()
        queue = _queue(r, model if model is not None else named)
        batch = _submit_file(r, path, queue, defaults, priority, completion_window, name=input_file,
                             metadata=metadata)
        if batch.counts.total == 0:
            if as_json:
                _print_json(batch.to_openai())
            first = f" ({_first_error(batch)})" if batch.errors else ""
            raise UserError(f"no valid requests in {input_file}{first}")
        if not as_json:  # the id on stdout, unless stdout carries the results
            click.echo(batch.id, err=wait and str(output_path) == STDIO)
        if wait:
            _wait(r, batch, path, output_path, errors_file, as_json)
            return
    if as_json:
        _print_json(batch.to_openai())
    if batch.counts.invalid:
        click.echo(f"{batch.counts.invalid} bad lines, first {_first_error(batch)}; "
                   f"`sluice results {batch.id} -o OUT` writes them to OUT's errors file", err=True)
        sys.exit(EXIT_SOME_FAILED)


def _submit_file(r: redis.Redis, path: Path, queue: str, defaults: SamplingParams, priority: int,
                 window: float, name: str, metadata: dict[str, str] | None = None) -> Batch:
    batch_id = keys.new_batch_id()
    try:
        with _open_lines(path) as lines:
            return submit(lines, r=r, model=queue, defaults=defaults, priority=priority, completion_window=window,
                          input_name=name, batch_id=batch_id, metadata=metadata)
    except KeyboardInterrupt:  # half a batch would wait forever in "validating"
        cancel_batch(r, batch_id)
        interrupted(f"interrupted while submitting: batch {batch_id} cancelled")
        raise


def _wait(r: redis.Redis, batch: Batch, input_file: Path, output: Path | None, errors_file: Path | None,
          as_json: bool) -> None:
    out = output or default_output_path(input_file)
    files = ResultFiles(out, errors_file or default_errors_path(out))
    _write_line_errors(r, batch, files, input_file)
    final = _follow(r, batch, files, progress=True)
    if as_json:
        _print_json(final.to_openai())
    _exit_for(final, files)


def _first_error(batch: Batch) -> str:
    e = batch.errors[0]
    return f"line {e.line}: {e.message}"


def _open_lines(path: Path) -> Any:
    try:
        # Undecodable bytes are kept as escapes: that line is rejected as not UTF-8, not the whole file.
        return path.open(encoding="utf-8", errors="surrogateescape", newline="\n")
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or one_line(e)}") from None


def _first_model(path: Path) -> str | None:
    with _open_lines(path) as f:
        return first_model(f)


def _queue(r: redis.Redis, model: str | None) -> str:
    try:
        queue = resolve_model(r, model)
    except UnknownModel as e:
        raise UserError(str(e)) from None
    if queue not in served_queues(r):
        start = "sluice worker" + ("" if queue == "default" else f" --model {queue}")
        click.echo(f"note: no live worker serves {queue!r} yet; the jobs wait for one (`{start}`)", err=True)
    return queue


def _custom_ids(path: Path, line_numbers: set[int]) -> dict[int, str]:
    """custom_ids of some input lines, where they can be read (for the error lines of rejected ones)."""
    found: dict[int, str] = {}
    with _open_lines(path) as f:
        for line_no, text in enumerate(f, 1):
            if line_no in line_numbers:
                try:
                    cid = json.loads(text).get("custom_id")
                except (ValueError, AttributeError):
                    continue
                if isinstance(cid, str):
                    found[line_no] = cid
    return found


def _write_line_errors(r: redis.Redis, batch: Batch, files: ResultFiles, input_file: Path | None = None) -> None:
    errors = get_line_errors(r, batch.id) if batch.counts.invalid else []
    cids = _custom_ids(input_file, {e.line for e in errors}) if input_file is not None and errors else {}
    for e in errors:
        files.add_line_error(e, cids.get(e.line))


def _follow(r: redis.Redis, batch: Batch, files: ResultFiles, progress: bool, follow: bool = True) -> Batch:
    """Write results as they land until the batch is final (or, without ``follow``, those there now)."""
    bar = tqdm(total=batch.counts.total, initial=files.resumed_jobs, unit="req", file=sys.stderr,
               disable=not progress or None, dynamic_ncols=True)
    t0 = time.monotonic()
    try:
        for res in iter_results(r, batch.id, follow=follow):
            if files.add_result(res):
                bar.update(1)
                bar.set_postfix_str(f"{files.tokens / max(time.monotonic() - t0, 1e-6):.0f} tok/s", refresh=False)
    except KeyboardInterrupt:
        bar.close()
        files.close()
        interrupted(f"stopped; batch {batch.id} runs on, and rerunning `sluice results {batch.id} "
                    f"-o {files.out_path}` resumes")
    bar.close()
    files.close()
    return require_batch(get_batch(r, batch.id), batch.id)


def _exit_for(batch: Batch, files: ResultFiles) -> None:
    click.echo(f"{batch.status}: {files.summary()}", err=True)
    c = batch.counts
    if c.failed or c.cancelled or c.expired or c.invalid:
        sys.exit(EXIT_SOME_FAILED)


# ---- status, results, cancel, batches --------------------------------------------------------------
@click.command("status")
@click.argument("batch_id")
@click.option("--watch", is_flag=True, help="Refresh until the batch is final.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True, help="With --watch.")
@json_option
@job_server_errors
def status_cmd(batch_id: str, watch: bool, interval: float, as_json: bool) -> None:
    """A batch's status, request counts, tokens/s and ETA (with --json --watch, one JSON line per refresh)."""
    r = open_server()
    try:
        for batch in _watch(r, batch_id, watch, interval):
            if as_json:
                _print_json(batch.to_openai())
                continue
            if watch and sys.stdout.isatty():
                click.clear()
            click.echo(status_text(batch, rates(batch, recent_results(r, batch.id))))
    except KeyboardInterrupt:
        interrupted("stopped watching")


def _watch(r: redis.Redis, batch_id: str, watch: bool, interval: float) -> Iterator[Batch]:
    while True:
        batch = require_batch(get_batch(r, batch_id), batch_id)
        yield batch
        if not watch or batch.is_final:
            return
        time.sleep(interval)


@click.command("results")
@click.argument("batch_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, allow_dash=True), default=None,
              help="Completed requests' lines go here (appended to: a rerun resumes). Default (or -): every "
              "line to stdout. A .parquet or .csv name (or --output-format): the batch's dataset rows with "
              "result columns, rewritten.")
@click.option("--errors", "errors_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Failed requests and bad input lines [default: OUTPUT with .errors].")
@click.option("--follow", is_flag=True, help="Keep writing results as they land until the batch is final.")
@click.option("--progress/--no-progress", default=True, help="A progress bar while following into OUTPUT.")
@click.option("--source", metavar="PATH_OR_URL", default=None, help="The dataset the batch's rows came from, to "
              "join its results to [default: the one it was submitted from].")
@with_row_options()
@job_server_errors
def results_cmd(batch_id: str, output: str | None, errors_file: Path | None, follow: bool, progress: bool,
                source: str | None, rows: RowFlags) -> None:
    """A batch's results so far (or, with --follow, as they land), as OpenAI batch output lines; or,
    into a dataset file, every row of the batch's dataset with its result columns."""
    r = open_server()
    if output is not None and (source is not None or wants_dataset(rows, output)):
        if errors_file is not None:
            raise UsageLine("--errors is for JSONL lines: a dataset's rows carry their errors in OUTPUT's error "
                            "column")
        results_dataset(r, batch_id, output, source, rows, follow, progress)
        return
    batch = require_batch(get_batch(r, batch_id), batch_id)
    if output is None or output == STDIO:
        _results_to_stdout(r, batch, follow)
        return
    files = ResultFiles(Path(output), errors_file or default_errors_path(Path(output)))
    _write_line_errors(r, batch, files)
    final = _follow(r, batch, files, progress=progress and follow, follow=follow)
    if final.is_final:
        _exit_for(final, files)
    else:
        click.echo(f"{final.status} (so far): {files.summary()}", err=True)


def _results_to_stdout(r: redis.Redis, batch: Batch, follow: bool) -> None:
    for e in get_line_errors(r, batch.id) if batch.counts.invalid else []:
        click.echo(f"line {e.line}: {e.message}", err=True)
    try:
        for res in iter_results(r, batch.id, follow=follow):
            echo_line(res)
    except KeyboardInterrupt:
        interrupted("stopped following")


@click.command("cancel")
@click.argument("batch_id")
@json_option
@job_server_errors
def cancel_cmd(batch_id: str, as_json: bool) -> None:
    """Cancel a batch: requests not yet finished are cancelled; finished results stay."""
    r = open_server()
    batch = require_batch(cancel_batch(r, batch_id), batch_id)
    if batch.status not in ("cancelling", "cancelled"):
        raise UserError(f"batch {batch_id} is already {batch.status}; nothing to cancel")
    if as_json:
        _print_json(batch.to_openai())
        return
    c = batch.counts
    click.echo(f"{batch.id} {batch.status}: {c.completed} completed results kept, {c.cancelled} cancelled")


@click.command("batches")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Batches per page.")
@click.option("--after", default=None, metavar="BATCH_ID", help="The page after this batch (the last one listed).")
@json_option
@job_server_errors
def batches_cmd(limit: int, after: str | None, as_json: bool) -> None:
    """List batches, newest first, a page at a time (--json: OpenAI's list object, with has_more)."""
    r = open_server()
    page = page_batches(r, limit=limit, after=after)
    if page is None:
        raise UserError(f"no batch {after!r} to list after (`sluice batches` lists them)")
    if as_json:
        _print_json(page.to_openai())
        return
    if not page.batches:
        click.echo("no batches", err=True)
        return
    click.echo(f"{'ID':<32} {'STATUS':<11} {'DONE/TOTAL':>13} {'FAILED':>7}  {'CREATED':<19}  MODEL")
    for b in page.batches:
        c = b.counts
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(b.created_at))
        click.echo(f"{b.id:<32} {b.status:<11} {f'{c.done}/{c.total}':>13} {c.done - c.completed:>7}  {created}  "
                   f"{b.model}")
    if page.has_more:
        click.echo(f"more: sluice batches --after {page.batches[-1].id}", err=True)
