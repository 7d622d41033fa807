"""A dataset's rows through the engine in-process (``sluice generate`` on a dataset, and
``sluice.generate``): requests are read from the source as the engine has room for them, and each
result is joined to its row by the ResultsWriter as it finishes, so neither the rows nor their
requests are all in memory at once. The engine loop is worker/runner.py's, as for JSONL lines."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sluice.jobs.datasets import ResultsWriter, RowError, RowSpec, Source, WriteSummary, read_requests
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.openai_output import result_to_output_line
from sluice.jobs.prefix_plan import planned
from sluice.jobs.schemas import Job, SamplingParams


def generate_rows(source: Source, spec: RowSpec, writer: ResultsWriter, engine: Callable[[], Any], *,
                  defaults: SamplingParams | None = None, resume: bool = False,
                  progress: bool = True, plan: bool = True) -> WriteSummary:
    """Every row of ``source`` (less those ``writer`` has, on a resume) through the engine ``engine()``
    makes (called only when some row needs it: a resume with nothing left loads no model); returns
    the closed writer's summary. ``plan``: rows reach the engine grouped by shared prompt prefix within
    windows of prefix_plan.PLAN_WINDOW rows (the output keeps the source's order)."""
    jobs = _jobs(source, spec, defaults, writer, resume)
    if plan:
        jobs = planned(jobs)
    first = next(jobs, None)
    if first is not None:
        run_jobs(engine(), _chain(first, jobs), writer, progress, total=source.num_rows())
    return writer.close()


def run_jobs(engine: Any, jobs: Iterator[Job], writer: ResultsWriter, progress: bool = True,
             total: int | None = None) -> None:
    """Feed ``jobs`` to ``engine`` a window at a time (worker/runner.py) and give each result to
    ``writer`` as it finishes (the writer puts it at its row: the output keeps the source's order)."""
    from sluice.worker import runner

    def refuse(job: Job, why: str) -> None:  # settings the engine refuses: that row's error
        writer.add_error(RowError(job.line - 1, job.custom_id, "invalid_request", why))

    runner.run(engine, jobs, lambda job, result: writer.add(result_to_output_line(job, result)),
               progress=progress, total=total, on_refused=refuse)


def _jobs(source: Source, spec: RowSpec, defaults: SamplingParams | None, writer: ResultsWriter,
          resume: bool) -> Iterator[Job]:
    """The rows' jobs, read as needed; rows that do not render go to the writer as errors."""
    skip: Callable[[str], bool] | None = writer.done if resume else None
    for item in read_requests(source, spec, skip=skip):
        if isinstance(item, RowError):
            writer.add_error(item)
            continue
        try:
            job = parse_line(item.line, item.row + 1, defaults)
        except LineError as e:  # a default the row's own values make invalid (min_tokens > max_tokens)
            writer.add_error(RowError(item.row, item.custom_id, e.code, e.message))
            continue
        job.id = job.custom_id
        yield job


def _chain(first: Job, rest: Iterator[Job]) -> Iterator[Job]:
    yield first
    yield from rest
