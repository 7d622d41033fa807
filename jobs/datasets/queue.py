"""A dataset's rows through the job queue: submitted as a batch's lines (line n is row n - 1), and the
batch's results joined back to the rows (``sluice submit``/``results`` on a dataset, ``sluice.submit``).

A batch submitted here names its source and row spec in its ``dataset`` field, so ``sluice results``
can join its results to the rows later without being told again how they were made. That field is
apart from the batch's metadata, which an API client writes: only what ``submit_rows`` wrote is ever
read back as a source to open or a template to render.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from typing import Any

import redis
from sluice.jobs.datasets.readers import Source
from sluice.jobs.datasets.rows import RowError, RowSpec, read_requests
from sluice.jobs.datasets.writers import ResultsWriter, WriteSummary
from sluice.jobs.schemas import Batch
from sluice.jobs.store import get_line_errors, output_lines
from sluice.jobs.submit import submit

SOURCE = "source"  # in a batch's dataset field: the source's URL (a local path made absolute)
ROWS = "rows"  # in a batch's dataset field: the RowSpec's fields that are set


def submit_rows(source: Source, spec: RowSpec, r: redis.Redis, *, metadata: dict[str, str] | None = None,
                **submit_kw: Any) -> tuple[Batch, list[RowError]]:
    """Queue every row that renders; returns the batch and the rows that were not queued (did not
    render, or ``submit`` refused the line), with why."""
    row_errors: list[RowError] = []

    def lines() -> Iterator[str]:
        for item in read_requests(source, spec):
            if isinstance(item, RowError):
                row_errors.append(item)
                yield ""  # a blank line keeps the batch's line numbers at row numbers + 1
            else:
                yield item.line

    batch = submit(lines(), r=r, metadata=metadata, input_name=source.url, dataset=dataset_field(source, spec),
                   **submit_kw)
    return batch, row_errors + refused_rows(r, batch)


def refused_rows(r: redis.Redis, batch: Batch) -> list[RowError]:
    """Lines ``submit`` refused (a row's settings with the defaults) as row errors: line n is row n - 1."""
    if not batch.counts.invalid:
        return []
    return [RowError(e.line - 1, None, e.code, e.message) for e in get_line_errors(r, batch.id)]


def render_errors(source: Source, spec: RowSpec) -> list[RowError]:
    """The rows that do not render, found again by reading the source (for a join without the list
    the submission made)."""
    return [i for i in read_requests(source, spec) if isinstance(i, RowError)]


def join_results(r: redis.Redis, batch_id: str, writer: ResultsWriter, row_errors: list[RowError], *,
                 follow: bool = False, on_result: Callable[[], None] | None = None) -> WriteSummary:
    """Write every row with its result: the batch's results so far (``follow``: as they land, until it
    ends); rows left without one get ``no_result``. Returns the closed writer's summary."""
    for e in row_errors:
        writer.add_error(e)
    for line in output_lines(r, batch_id, follow=follow):
        writer.add(line)
        if on_result is not None:
            on_result()
    return writer.close()


def dataset_field(source: Source, spec: RowSpec) -> dict[str, Any] | None:
    """The batch's dataset field naming ``source`` and ``spec`` (None for an in-memory source)."""
    if source.fs is None and source.format not in ("hub",):
        return None
    url = source.url if "://" in source.url else os.path.abspath(source.url)
    given = {k: v for k, v in asdict(spec).items() if v != getattr(RowSpec, k, None) and v is not None}
    if spec.template_file and "://" not in spec.template_file:
        given["template_file"] = os.path.abspath(spec.template_file)
    return {SOURCE: url, ROWS: given}


def spec_of(batch: Batch) -> tuple[str | None, RowSpec | None]:
    """The source URL and RowSpec ``submit_rows`` recorded for a batch (None, None for any other batch:
    JSONL lines, or a batch made through the API, whatever its metadata says)."""
    ds = batch.dataset or {}
    url, rows = ds.get(SOURCE), ds.get(ROWS)
    if not isinstance(url, str) or not isinstance(rows, dict):
        return None, None
    known = {f.name for f in fields(RowSpec)}
    return url, RowSpec(**{k: v for k, v in rows.items() if k in known})
