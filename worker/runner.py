"""The in-process runner of ``sluice generate`` and ``sluice.generate``: jobs (from JSONL lines or a
dataset's rows) through an engine of any kind (generation, embeddings, scores), no Redis.

Jobs are pulled from their iterator only while fewer than ``window`` engine requests are in flight,
and each job's Result goes to ``on_result`` the moment its last request finishes: memory holds the
window, never the input. A list prompt's job runs as one request per prompt (worker/convert.Parts).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from sluice.engine.config import EngineConfig
from sluice.engine.factory import build_engine
from sluice.jobs.schemas import ErrorInfo, Job, Result
from sluice.worker.convert import Parts
from sluice.worker.kinds import GENERATION, engine_request, engine_result, serves
from sluice.worker.progress import Progress, progress_bar

WINDOW_PER_SEQ = 2  # requests in flight per engine slot: the scheduler always has the next ones waiting

OnResult = Callable[[Job, Result], None]
OnRefused = Callable[[Job, str], None]  # a job the engine refused before running it, and why


def window_of(engine: Any) -> int:
    """Requests in flight at most for this engine (any kind has ``config.max_num_seqs``)."""
    return WINDOW_PER_SEQ * engine.config.max_num_seqs


class Runner:
    """One engine, fed from one iterator of jobs. ``run()`` returns when every job has its Result."""

    def __init__(self, engine: Any, jobs: Iterator[Job], on_result: OnResult, *, window: int | None = None,
                 progress: Progress | None = None, on_refused: OnRefused | None = None) -> None:
        self.engine = engine
        self.jobs = jobs
        self.on_result = on_result
        self.on_refused = on_refused or (lambda job, why: on_result(job, refused(job, why)))
        self.window = window or window_of(engine)
        self.progress = progress
        self.finished_tokens = 0
        self.parts: dict[str, Parts] = {}  # engine request id -> its job's parts
        self.next_id = 0
        self.more = True

    @property
    def in_flight(self) -> int:
        return len(self.parts)

    def run(self) -> None:
        while self._fill() or self.parts:
            finished = 0
            for out in self.engine.step():
                finished += self._finish(out)
            if self.progress is not None:
                self.progress.advance(finished, self.tokens_sampled)

    def _fill(self) -> bool:
        """Pull jobs until the window is full or the input ends; whether any request is in flight."""
        while self.more and len(self.parts) < self.window:
            job = next(self.jobs, None)
            if job is None:
                self.more = False
                break
            self._add(job)
        return bool(self.parts)

    def _add(self, job: Job) -> None:
        parts = self._parts(job)
        try:  # the other kind than the model serves, or settings it refuses: that job fails alone
            requests = [engine_request(p, r, self.engine) for p, r in zip(parts.jobs, parts.rids, strict=True)]
        except ValueError as e:
            self.on_refused(job, str(e))
            return
        for rid, request in zip(parts.rids, requests, strict=True):
            self.parts[rid] = parts
            self.engine.add_request(request)

    def _parts(self, job: Job) -> Parts:
        """The job's engine requests, named by its id (a list prompt's "id/0", "id/1"...); another id
        when one of those is in flight already (a custom_id "a/0" beside a list prompt "a")."""
        parts = Parts.of(job, job.id or job.custom_id)
        while any(rid in self.parts for rid in parts.rids):
            self.next_id += 1
            parts = Parts.of(job, f"{job.id or job.custom_id}#{self.next_id}")
        return parts

    def _finish(self, out: Any) -> int:
        parts = self.parts.pop(out.request_id)
        part = parts.jobs[parts.rids.index(out.request_id)]
        result = parts.add(out.request_id, engine_result(part, out, self.engine, started=None, worker=None, model=None))
        if result is None:  # a list prompt's job: once every prompt's is in
            return 0
        self.finished_tokens += result.usage.completion_tokens
        self.on_result(parts.job, result)
        return 1

    def tokens_sampled(self) -> int:
        """Finished jobs' tokens and those sampled so far in flight (a generation engine's)."""
        if serves(self.engine) != GENERATION:  # embeddings or scores: nothing is sampled
            return self.finished_tokens
        flying = 0
        for rid in self.parts:
            now = self.engine.tokens_so_far(rid)
            if now is not None:  # (prompt length, each sample's ids with the prompt first)
                flying += sum(len(ids) - now[0] for ids in now[1])
        return self.finished_tokens + flying


def refused(job: Job, message: str) -> Result:
    """A job the engine would not take, as its failed Result."""
    return Result(job_id=job.id, custom_id=job.custom_id, kind=job.kind, status="failed",
                  error=ErrorInfo(code="invalid_request", message=message))


def run(engine: Any, jobs: Iterator[Job], on_result: OnResult, *, progress: bool = False,
        total: int | None = None, on_refused: OnRefused | None = None) -> None:
    """Every job of ``jobs`` through ``engine``, each Result to ``on_result`` as it finishes (a job
    refused before it ran: to ``on_refused``, else as a failed Result)."""
    if not progress:
        Runner(engine, jobs, on_result, on_refused=on_refused).run()
        return
    bar = progress_bar(total)
    runner = Runner(engine, jobs, on_result, progress=bar, on_refused=on_refused)
    try:
        runner.run()
    finally:
        bar.close(runner.tokens_sampled())


# ---- the engine a run needs ------------------------------------------------------------------------
def sized_engine(model: str | None, engine_kwargs: dict[str, Any], first: list[Job]) -> Any:
    """The engine ``model`` needs (engine/factory.py), for a run that starts with the jobs ``first``: no
    more sequence slots than they need when they are the whole run."""
    return build_engine(model, _fitted(engine_kwargs, first))


def _fitted(engine_kwargs: dict[str, Any], jobs: list[Job]) -> dict[str, Any]:
    """The engine settings for a file that starts with these jobs: no more sequence slots than the file
    has sequences. The engine sizes its KV cache for at most every slot at full length, so a short file
    gets a small cache, and faulting in the default 4 GiB took 5-12 s of start-up here."""
    need = sum(sequences(j) for j in jobs)
    limit = engine_kwargs.get("max_num_seqs") or EngineConfig.max_num_seqs
    return {**engine_kwargs, "max_num_seqs": min(limit, need)}


def sequences(job: Job) -> int:
    """Engine sequences a job runs as (n samples of each prompt)."""
    return job.params.n * len(job.prompts or [None])
