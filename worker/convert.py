"""Job -> engine Request, engine Completion -> Result."""

from __future__ import annotations

import time
from typing import Any

from engine.outputs import Completion, Request
from engine.outputs import TokenLogprob as EngineLogprob
from engine.sampling_params import SamplingParams as EngineParams
from jobs.schemas import (
    Choice,
    ErrorInfo,
    Job,
    Result,
    ResultTimings,
    ResultUsage,
    TokenLogprob,
    TopLogprob,
)


def job_to_request(job: Job, request_id: str | None = None, vocab_size: int | None = None) -> Request:
    """The engine request of a job (id: ``request_id``, else the job's id, else its custom_id).
    Raises ValueError for settings the engine refuses, and token ids outside ``vocab_size``."""
    p = job.params
    if vocab_size is not None and any(t >= vocab_size for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
    params = EngineParams(**{**p.model_dump(), "stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids)})
    return Request(request_id or job.id or job.custom_id, prompt=job.prompt, messages=job.messages, prompt_token_ids=job.prompt_token_ids,
                   params=params)


def bare_result(job: Job, status: str, code: str, message: str, worker: str | None = None,
                model: str | None = None) -> Result:
    """The outcome of a job that did not run to its end (cancelled, expired, failed)."""
    return Result(job_id=job.id, custom_id=job.custom_id, batch_id=job.batch_id, idx=job.idx, kind=job.kind,
                  model=job.model or model, status=status, error=ErrorInfo(code=code, message=message),
                  worker=worker, timings=ResultTimings(submitted=job.created_at or None, finished=time.time()))


def completion_to_result(job: Job, c: Completion, tokenizer: Any, *, started: float | None = None,
                         worker: str | None = None, model: str | None = None) -> Result:
    """A finished engine request as the job's Result (``tokenizer`` spells out logprob tokens)."""
    failed = c.error is not None or c.finish_reason == "error"
    choices: list[Choice] = []
    if len(c.outputs) > 1 or any(o.logprobs is not None for o in c.outputs):
        decode = _Decoder(tokenizer)
        choices = [Choice(index=o.index, text=o.text, finish_reason=o.finish_reason,
                          logprobs=decode.logprobs(o.logprobs)) for o in c.outputs]
    return Result(
        job_id=job.id, custom_id=job.custom_id, batch_id=job.batch_id, idx=job.idx, kind=job.kind,
        model=job.model or model, status="failed" if failed else "completed", text=c.text,
        finish_reason=c.finish_reason, choices=choices,
        usage=ResultUsage(prompt_tokens=c.usage.prompt_tokens, completion_tokens=c.usage.completion_tokens,
                          cached_tokens=c.usage.cached_tokens),
        timings=ResultTimings(submitted=job.created_at or None, started=started, first_token=c.timings.first_token,
                              finished=c.timings.finished or time.time()),
        worker=worker,
        # The engine fails a request only for what it is (too long, bad token ids): retrying won't help.
        error=ErrorInfo(code="invalid_request", message=c.error or "the engine refused the request") if failed else None,
    )


class _Decoder:
    """Token texts for logprobs, each id decoded once."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        s = self.cache.get(token_id)
        if s is None:
            s = self.cache[token_id] = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
        return s

    def logprobs(self, lps: list[EngineLogprob | None] | None) -> list[TokenLogprob] | None:
        if lps is None:
            return None
        return [TokenLogprob(token_id=t.token_id, token=self.text(t.token_id), logprob=t.logprob,
                             top=[TopLogprob(token_id=i, token=self.text(i), logprob=lp) for i, lp in t.top])
                for t in lps if t is not None]
