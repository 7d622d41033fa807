"""``sluice generate``: a JSONL file through the engine in-process, no Redis.

Lines are read as the engine has room for them (worker/runner.py) and each result line is written and
flushed the moment its request finishes, so memory holds a window of lines, and an interrupted run keeps
what finished; ``resume`` skips custom_ids already in the output or errors file. Completed requests go
to the output; failed ones, and bad lines (naming their line number), to the errors file; the rest runs.
A run that completes puts both files back in input order (worker/line_order.py); stdout stays in finish
order.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sluice.engine.config import EngineConfig
from sluice.engine.embedding_engine import EmbeddingEngine
from sluice.engine.llm import LLM
from sluice.jobs import prefix_plan
from sluice.jobs.jsonl import values_in
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.openai_output import result_to_output_line
from sluice.jobs.schemas import Job, Result, SamplingParams
from sluice.worker import runner
from sluice.worker.line_order import custom_id_of, sort_by_input


@dataclass
class GenerateSummary:
    completed: int = 0
    failed: int = 0
    bad_lines: int = 0
    skipped: int = 0
    completion_tokens: int = 0


def generate_file(input_path: Path, output_path: Path, errors_path: Path, *, model: str | None,
                  engine_kwargs: dict[str, Any], defaults: SamplingParams | None = None, resume: bool = False,
                  progress: bool = True, llm: LLM | EmbeddingEngine | None = None,
                  plan: bool = True) -> GenerateSummary:
    """``plan``: the engine takes the lines grouped by shared prompt prefix (jobs/prefix_plan.py), not in
    file order; each result is written as it finishes, and a completed run's files are put back in input order."""
    summary = GenerateSummary()
    rank: dict[str, int] = {}  # custom_id -> its line in the input: the order results are put back in
    done = values_in(output_path, "custom_id") | values_in(errors_path, "custom_id") if resume else set()
    combined = errors_path == output_path  # one stream for both (stdout): failures in line with results
    if not resume:
        output_path.write_text("")
        if not combined:
            errors_path.unlink(missing_ok=True)
    # Undecodable bytes kept as escapes: that line fails as not UTF-8, the rest runs.
    with output_path.open("a") as out, (nullcontext(out) if combined else _LazyFile(errors_path)) as err, \
            input_path.open(encoding="utf-8", errors="surrogateescape") as src:
        jobs = _read_jobs(src, defaults, done, err, summary, rank)
        if plan:
            jobs = prefix_plan.planned(jobs)
        # The engine is sized by the first jobs (a short file: a small KV cache), read ahead only that far.
        head = _head(jobs, engine_kwargs.get("max_num_seqs") or EngineConfig.max_num_seqs)
        if not head:
            return summary
        engine = llm if llm is not None else runner.sized_engine(model, engine_kwargs, head)

        def write(job: Job, result: Result) -> None:
            _write_line(out if result.status == "completed" else err, result_to_output_line(job, result))
            summary.completion_tokens += result.usage.completion_tokens
            if result.status == "completed":
                summary.completed += 1
            else:
                summary.failed += 1

        runner.run(engine, itertools.chain(head, jobs), write, progress=progress)
    for path in {output_path, errors_path}:  # closed now; stdout (a character device) is left as written
        sort_by_input(path, rank)
    return summary


def _head(jobs: Iterator[Job], sequences: int) -> list[Job]:
    """The first jobs, up to ``sequences`` engine sequences of them (all of a shorter input)."""
    head: list[Job] = []
    while sum(runner.sequences(j) for j in head) < sequences:
        job = next(jobs, None)
        if job is None:
            break
        head.append(job)
    return head


def _read_jobs(lines: Iterable[str], defaults: SamplingParams | None, done: set[str], out: Any,
               summary: GenerateSummary, rank: dict[str, int]) -> Iterator[Job]:
    seen: set[str] = set()
    for line_no, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            job = parse_line(text, line_no, defaults)
            if job.custom_id in seen:
                raise LineError(line_no, "duplicate_custom_id", f"custom_id {job.custom_id!r} appears twice")
        except LineError as e:
            key = custom_id_of(text) or f"line-{line_no}"
            rank.setdefault(key, line_no)
            if key in done:
                continue
            summary.bad_lines += 1
            _write_line(out, {"id": f"line-{line_no}", "custom_id": key, "response": None,
                              "error": {"code": e.code, "message": str(e), "line": line_no}})
            continue
        seen.add(job.custom_id)
        rank[job.custom_id] = line_no
        job.id = job.custom_id  # no batch here: the custom_id names the request and its result
        if job.custom_id in done:
            summary.skipped += 1
            continue
        yield job


class _LazyFile:
    """A file opened for appending on its first write: no empty errors file when nothing failed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f: IO[str] | None = None

    def write(self, text: str) -> None:
        if self.f is None:
            self.f = self.path.open("a")
        self.f.write(text)

    def flush(self) -> None:
        if self.f is not None:
            self.f.flush()

    def __enter__(self) -> _LazyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.f is not None:
            self.f.close()


def _write_line(out: Any, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj, ensure_ascii=False) + "\n")
    out.flush()
