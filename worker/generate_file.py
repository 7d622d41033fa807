"""``sluice generate``: a JSONL file through the engine in-process, no Redis.

Each result line is written and flushed the moment its request finishes, so an interrupted run keeps
what finished; ``resume`` skips custom_ids already in the output or errors file. Completed requests go
to the output; failed ones, and bad lines (naming their line number), to the errors file; the rest runs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sluice.engine.config import EngineConfig
from sluice.engine.cross_encoder import is_cross_encoder_model
from sluice.engine.embedding_engine import EmbeddingEngine, EmbeddingOutput, EmbeddingRequest
from sluice.engine.embedding_model import is_embedding_model
from sluice.engine.factory import build_engine
from sluice.engine.llm import LLM
from sluice.engine.outputs import Completion
from sluice.jobs import prefix_plan
from sluice.jobs.jsonl import values_in
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.openai_output import result_to_output_line
from sluice.jobs.schemas import ErrorInfo, Job, Result, SamplingParams
from sluice.worker.convert import Parts
from sluice.worker.kinds import GENERATION, engine_request, engine_result, serves
from sluice.worker.progress import generate


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
    file order; each result line is written as it finishes either way."""
    summary = GenerateSummary()
    done = values_in(output_path, "custom_id") | values_in(errors_path, "custom_id") if resume else set()
    combined = errors_path == output_path  # one stream for both (stdout): failures in line with results
    if not resume:
        output_path.write_text("")
        if not combined:
            errors_path.unlink(missing_ok=True)
    # Undecodable bytes kept as escapes: that line fails as not UTF-8, the rest runs.
    with output_path.open("a") as out, (nullcontext(out) if combined else _LazyFile(errors_path)) as err, \
            input_path.open(encoding="utf-8", errors="surrogateescape") as src:
        jobs = list(_read_jobs(src, defaults, done, err, summary))
        if plan:
            jobs = prefix_plan.plan(jobs)
        if not jobs:
            return summary
        engine = llm if llm is not None else _engine(model, engine_kwargs, jobs)
        by_rid: dict[str, Parts] = {}  # engine request id (by position: no custom_id can look like another's part) -> its parts

        def write_result(job: Job, result: Result) -> None:
            _write_line(out if result.status == "completed" else err, result_to_output_line(job, result))
            summary.completion_tokens += result.usage.completion_tokens
            if result.status == "completed":
                summary.completed += 1
            else:
                summary.failed += 1

        def write(c: Completion | EmbeddingOutput) -> None:
            parts = by_rid[c.request_id]
            part = parts.jobs[parts.rids.index(c.request_id)]
            result = parts.add(c.request_id, engine_result(part, c, engine, started=None, worker=None, model=None))
            if result is not None:  # a list prompt's job: once every prompt's is in
                write_result(parts.job, result)

        requests = []
        for i, j in enumerate(jobs):
            parts = Parts.of(j, str(i))
            try:  # the other kind than the model serves (an embeddings line for a generation model): that line fails
                requests += [engine_request(p, r, engine) for p, r in zip(parts.jobs, parts.rids, strict=True)]
                by_rid.update(dict.fromkeys(parts.rids, parts))
            except ValueError as e:
                write_result(j, Result(job_id=j.id, custom_id=j.custom_id, kind=j.kind, status="failed",
                                       error=ErrorInfo(code="invalid_request", message=str(e))))
        if serves(engine) != GENERATION:  # embeddings or scores: one forward pass each, no generation loop
            _embed(engine, requests, write)  # type: ignore[arg-type]
        else:
            generate(engine, requests, progress, on_finish=write)  # type: ignore[arg-type]
    return summary


def _engine(model: str | None, engine_kwargs: dict[str, Any], jobs: list[Job]) -> LLM | EmbeddingEngine:
    if is_cross_encoder_model(model) or is_embedding_model(model):
        if engine_kwargs.get("lora_modules") and not is_cross_encoder_model(model):
            raise ValueError("LoRA adapters (--lora) need a generation model, not an embedding model")
        return build_engine(model, engine_kwargs)  # type: ignore[return-value]
    return build_engine(model, _fitted(engine_kwargs, jobs))  # type: ignore[return-value]


def _fitted(engine_kwargs: dict[str, Any], jobs: list[Job]) -> dict[str, Any]:
    """The engine settings for a file of these jobs: no more sequence slots than the file has sequences.
    The engine sizes its KV cache for at most every slot at full length, so a short file gets a small
    cache, and faulting in the default 4 GiB took 5-12 s of start-up here."""
    sequences = sum(j.params.n * len(j.prompts or [None]) for j in jobs)
    limit = engine_kwargs.get("max_num_seqs") or EngineConfig.max_num_seqs
    return {**engine_kwargs, "max_num_seqs": min(limit, sequences)}


def _embed(engine: EmbeddingEngine, requests: list[EmbeddingRequest],
           on_finish: Callable[[EmbeddingOutput], None]) -> None:
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished():
        for out in engine.step():
            on_finish(out)


def _read_jobs(lines: Iterable[str], defaults: SamplingParams | None, done: set[str], out: Any,
               summary: GenerateSummary) -> Iterable[Job]:
    seen: set[str] = set()
    for line_no, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            job = parse_line(text, line_no, defaults)
            if job.custom_id in seen:
                raise LineError(line_no, "duplicate_custom_id", f"custom_id {job.custom_id!r} appears twice")
        except LineError as e:
            key = _custom_id_of(text) or f"line-{line_no}"
            if key in done:
                continue
            summary.bad_lines += 1
            _write_line(out, {"id": f"line-{line_no}", "custom_id": key, "response": None,
                              "error": {"code": e.code, "message": str(e), "line": line_no}})
            continue
        seen.add(job.custom_id)
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


def _custom_id_of(text: str) -> str | None:
    try:
        v = json.loads(text).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return v if isinstance(v, str) and v else None


def _write_line(out: Any, obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj, ensure_ascii=False) + "\n")
    out.flush()
