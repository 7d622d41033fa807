"""``sluice.generate``: rows through the engine in this process, no job server (``sluice generate``'s
path: each result is joined to its row as it finishes)."""

from __future__ import annotations

from typing import Any

from jobs.datasets import RowError, WriteSummary, read_requests
from jobs.schemas import LineError, parse_line, result_to_output_line
from sluice.data import Data, joined, like, row_spec, sampling_defaults, source_of


def generate(data: Data, *, model: str | None = None, prompt_column: str | None = None,
             messages_column: str | None = None, template: str | None = None, template_file: str | None = None,
             system: str | None = None, id_column: str | None = None, chat: bool = True,
             output: str | None = None, resume: bool = False, progress: bool = True, llm: Any = None,
             engine_options: dict[str, Any] | None = None, storage_options: dict[str, Any] | None = None,
             **sampling: Any) -> Any:
    """Generate for every row of ``data``; returns ``data`` with the result columns added (same kind:
    DataFrame, Dataset, list of dicts; a pyarrow Table for a file), or, with ``output`` (a path or fsspec
    URL of a .parquet/.jsonl/.csv file), writes there and returns a WriteSummary.

    The text: ``prompt_column``, ``messages_column``, a ``template`` over the row's columns
    (``"Summarise: {text}"``) or a Jinja ``template_file``; without any, a ``messages`` or ``prompt``
    column. ``system`` leads each chat; ``id_column`` names rows (default: row number). Keyword
    sampling settings (``max_tokens=64, temperature=0.7``) apply to every row; columns named like them
    set their own row's. ``resume`` (with ``output``) skips rows a killed run already wrote.
    ``llm`` reuses a loaded ``engine.llm.LLM``; otherwise ``model`` is loaded with ``engine_options``
    (LLM keyword arguments). ``storage_options`` go to fsspec for a URL ``data`` and ``output``
    (``{"endpoint_url": ...}`` for an S3-compatible store).
    """
    from engine.llm import LLM
    from worker.convert import completion_to_result, job_to_request

    source = source_of(data, storage_options)
    spec = row_spec(prompt_column, messages_column, template, template_file, system, id_column, chat)
    defaults = sampling_defaults(sampling)
    with joined(source, spec, output, resume, storage_options=storage_options) as (writer, table):
        jobs = {}
        for item in read_requests(source, spec, skip=writer.done if resume else None):
            if isinstance(item, RowError):
                writer.add_error(item)
                continue
            try:
                job = parse_line(item.line, item.row + 1, defaults)
            except LineError as e:  # a default the row's own values make invalid (min_tokens > max_tokens)
                writer.add_error(RowError(item.row, item.custom_id, e.code, e.message))
                continue
            job.id = job.custom_id
            jobs[job.custom_id] = job
        if jobs:
            engine = llm if llm is not None else LLM(model, **(engine_options or {}))
            vocab = getattr(getattr(engine, "hf_config", None), "vocab_size", None)
            requests = []
            for job in list(jobs.values()):
                try:
                    requests.append(job_to_request(job, vocab_size=vocab))
                except ValueError as e:  # settings the engine refuses: that row's error
                    writer.add_error(RowError(job.line - 1, job.custom_id, "invalid_request", str(e)))
                    del jobs[job.custom_id]

            def finished(c: Any) -> None:
                job = jobs.pop(c.request_id)
                writer.add(result_to_output_line(job, completion_to_result(job, c, engine.tokenizer)))

            engine.generate(requests, progress=progress, on_finish=finished)
        summary: WriteSummary = writer.close()
        return summary if output is not None else like(table(), data)

