"""`sluice submit` and `sluice results` on datasets: the rows queued as a batch (line n is row n - 1),
and the batch's results written joined to the rows. The batch records its source and row flags (in a
field of its own that only `sluice submit` writes, never in the metadata an API client sets), so
`sluice results BATCH -o out.parquet` joins without being told them again (--source when the source
moved)."""

from __future__ import annotations

import sys
import time
from typing import Any

import click
import redis
from sluice.cli.common import EXIT_SOME_FAILED, UserError, interrupted, require_batch
from sluice.cli.datasets import (
    RowFlags,
    UsageLine,
    check_spec,
    dataset_errors,
    open_input,
    open_writer,
    run_writer,
    summary_text,
)
from sluice.cli.output import STDIO
from sluice.jobs.schemas import Batch, SamplingParams
from sluice.jobs.store import cancel_batch, get_batch
from tqdm import tqdm


def submit_dataset(r: redis.Redis, input_url: str, rows: RowFlags, queue: str, defaults: SamplingParams,
                   priority: int, window: float, *, wait: bool, output: str | None, as_json: bool,
                   metadata: dict[str, str] | None = None) -> None:
    """Queue the rows; print the batch id (or, with --json, the batch); with ``wait``, write the rows
    with their results to ``output`` as they land."""
    from sluice.jobs import keys
    from sluice.jobs.datasets.queue import submit_rows

    if STDIO in (input_url, output):
        raise UsageLine("a dataset is read from and written to a file or URL, not stdin or stdout (-)")
    with dataset_errors():
        spec = rows.spec()
        source = open_input(input_url)
        check_spec(source, spec)
        out = output or (_default_output(input_url, rows) if wait else None)
        writer = open_writer(out, source, spec, rows) if out is not None else None  # its errors before queueing
        batch_id = keys.new_batch_id()
        try:
            batch, row_errors = submit_rows(source, spec, r, model=queue, defaults=defaults, priority=priority,
                                            completion_window=window, batch_id=batch_id, metadata=metadata)
        except KeyboardInterrupt:  # half a batch would wait forever in "validating"
            cancel_batch(r, batch_id)
            interrupted(f"interrupted while submitting: batch {batch_id} cancelled")
            raise
        if batch.counts.total == 0:
            first = f" (first: {row_errors[0]})" if row_errors else ""
            raise UserError(f"no valid requests in {input_url}{first}")
        if not as_json:
            click.echo(batch.id)
        if writer is not None and out is not None:
            final, failed = _follow_into(r, batch, writer, row_errors, out, progress=True)
            if as_json:
                click.echo(_json(final))
            if failed:
                sys.exit(EXIT_SOME_FAILED)
            return
    if as_json:
        click.echo(_json(batch))
    if row_errors:
        click.echo(f"{len(row_errors)} rows not queued, first {row_errors[0]}; `sluice results {batch.id} -o "
                   "OUT.parquet` writes every row with its result or error", err=True)
        sys.exit(EXIT_SOME_FAILED)


def results_dataset(r: redis.Redis, batch_id: str, output: str, source_url: str | None, rows: RowFlags,
                    follow: bool, progress: bool) -> None:
    """`sluice results BATCH -o OUT.parquet`: every source row with its result (so far, or with
    ``follow`` as they land); rows without one yet get the error no_result."""
    from sluice.jobs.datasets.queue import refused_rows, render_errors, spec_of

    if output == STDIO:
        raise UsageLine("a dataset is written to a file or URL, not stdout (-)")
    batch = require_batch(get_batch(r, batch_id), batch_id)
    url, stored = spec_of(batch)
    source_url = source_url or url
    if source_url is None:
        raise UsageLine(f"batch {batch_id} was not submitted from a dataset: give --source, the rows to join "
                        "its results to")
    with dataset_errors():
        spec = rows.spec() if rows.row_given() or stored is None else stored
        source = open_input(source_url)
        check_spec(source, spec)
        writer = open_writer(output, source, spec, rows)
        errors = render_errors(source, spec) + refused_rows(r, batch)
        _, failed = _follow_into(r, batch, writer, errors, output, progress=progress and follow, follow=follow)
    if failed:
        sys.exit(EXIT_SOME_FAILED)


def _follow_into(r: redis.Redis, batch: Batch, writer: Any, row_errors: list[Any], output: str, *,
                 progress: bool, follow: bool = True) -> tuple[Batch, bool]:
    """Write the rows with their results; returns the batch now and whether it ended with failed rows."""
    from sluice.jobs.datasets.queue import join_results

    t0 = time.time()
    bar = tqdm(total=batch.counts.total, unit="req", file=sys.stderr, disable=not progress or None,
               dynamic_ncols=True)
    try:
        s = run_writer(writer, lambda: join_results(r, batch.id, writer, row_errors, follow=follow,
                                                    on_result=lambda: bar.update(1)),
                       f"stopped; batch {batch.id} runs on, and `sluice results {batch.id} -o {output}` writes "
                       "its rows again")
    finally:
        bar.close()
    final = require_batch(get_batch(r, batch.id), batch.id)
    click.echo(f"{final.status}{'' if final.is_final else ' (so far)'}: "
               f"{summary_text(s, time.time() - t0, output)}", err=True)
    return final, final.is_final and bool(s.failed or s.no_result)


def _default_output(input_url: str, rows: RowFlags) -> str:
    """in.parquet -> in.results.parquet (a URL too); a directory: DIR.results.parquet beside it."""
    base = input_url.rstrip("/")
    name = base.rsplit("/", 1)[-1]
    stem, dot, suffix = name.partition(".")
    suffix = rows.output_format or (suffix.split(".")[0] if dot and suffix.split(".")[0] in ("parquet", "jsonl",
                                                                                              "csv") else "parquet")
    return f"{base[:len(base) - len(name)]}{stem}.results.{suffix}"


def _json(batch: Batch) -> str:
    import json

    return json.dumps(batch.to_openai(), separators=(",", ":"))
