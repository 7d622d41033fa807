"""Job -> engine Request, engine Completion -> Result."""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from sluice.engine.outputs import Completion, CompletionOutput, Request
from sluice.engine.outputs import TokenLogprob as EngineLogprob
from sluice.jobs.lines import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from sluice.jobs.schemas import (
    Choice,
    ErrorInfo,
    Job,
    JobStatus,
    Result,
    ResultTimings,
    ResultUsage,
    TokenLogprob,
    TopLogprob,
)
from sluice.worker.sampling import engine_params

_TOOL_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def job_to_request(job: Job, request_id: str | None = None, vocab_size: int | None = None) -> Request:
    """The engine request of a job (id: ``request_id``, else the job's id, else its custom_id).
    Raises ValueError for settings the engine refuses, and token ids outside ``vocab_size``."""
    p = job.params
    if vocab_size is not None and any(t >= vocab_size for t in p.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
    params = engine_params(p)
    template_kwargs = json.loads(p.chat_template_kwargs) if p.chat_template_kwargs is not None else None
    return Request(request_id or job.id or job.custom_id, prompt=job.prompt, messages=job.messages, prompt_token_ids=job.prompt_token_ids,
                   params=params, tools=job.tools, chat_template_kwargs=template_kwargs, priority=job.priority)


# ---- a list prompt: one engine request per prompt, one Result for them all --------------------------
@dataclass
class Parts:
    """A job as the engine requests it runs as: itself, or (a list prompt) one per prompt, whose Results
    are merged into the job's once the last is in."""

    job: Job
    jobs: list[Job]
    rids: list[str]
    results: dict[int, Result] = field(default_factory=dict)

    @classmethod
    def of(cls, job: Job, rid: str) -> Parts:
        if job.prompts is None:
            return cls(job, [job], [rid])
        jobs = [job.model_copy(update={"prompts": None, **({"prompt": p} if isinstance(p, str)
                                                           else {"prompt_token_ids": p})}) for p in job.prompts]
        return cls(job, jobs, [f"{rid}/{k}" for k in range(len(jobs))])

    def first_index(self, rid: str) -> int:
        """The choice index of this part's first sample (OpenAI's order: prompt index x n + sample)."""
        return self.rids.index(rid) * self.job.params.n

    def add(self, rid: str, result: Result) -> Result | None:
        """The job's Result once every part's is in (None until then)."""
        self.results[self.rids.index(rid)] = result
        if len(self.results) < len(self.rids):
            return None
        if self.job.prompts is None:
            return result
        return merge_results(self.job, [self.results[k] for k in range(len(self.rids))])


def merge_results(job: Job, parts: list[Result]) -> Result:
    """A list prompt's Result: every prompt's choices in order, usage summed; failed if a prompt failed."""
    n = job.params.n
    choices = []
    for k, r in enumerate(parts):
        own = r.choices or [Choice(index=0, text=r.text, finish_reason=r.finish_reason or "stop")]
        choices += [c.model_copy(update={"index": k * n + c.index}) for c in own]
    failed = next(((k, r) for k, r in enumerate(parts) if r.status != "completed"), None)
    status: JobStatus = "completed"
    error = None
    if failed is not None:
        k, r = failed
        status = r.status
        if r.error is not None:
            error = ErrorInfo(code=r.error.code, message=f"prompt[{k}]: {r.error.message}")
    firsts = [r.timings.first_token for r in parts if r.timings.first_token is not None]
    first = parts[0]
    return first.model_copy(update={
        "status": status, "error": error, "text": choices[0].text, "finish_reason": choices[0].finish_reason,
        "choices": choices,
        "usage": ResultUsage(**{f: sum(getattr(r.usage, f) for r in parts) for f in ResultUsage.model_fields}),
        "timings": first.timings.model_copy(update={"first_token": min(firsts, default=None),
                                                    "finished": max(r.timings.finished or 0 for r in parts)})})


def completion_to_result(job: Job, c: Completion, tokenizer: Any, *, started: float | None = None,
                         worker: str | None = None, model: str | None = None) -> Result:
    """A finished engine request as the job's Result (``tokenizer`` spells out logprob tokens)."""
    failed = c.error is not None or c.finish_reason == "error"
    decode = _Decoder(tokenizer)
    echo = _prompt_text(job, decode) if job.echo else ""
    score_only = job.params.max_tokens == 0 and not failed
    outputs = [_scored_only(o) for o in c.outputs] if score_only else c.outputs
    prompt_lps = decode.prompt_logprobs(c.prompt_logprobs, c.prompt_token_ids)
    choices = [_choice(job, o, echo, decode, prompt_lps) for o in outputs]
    keep = len(choices) > 1 or any(x.logprobs is not None or x.tool_calls or x.reasoning is not None
                                   or x.prompt_logprobs is not None for x in choices)
    return Result(
        job_id=job.id, custom_id=job.custom_id, batch_id=job.batch_id, idx=job.idx, kind=job.kind, api=job.api,
        model=job.model or model, status="failed" if failed else "completed", text=choices[0].text if choices else "",
        finish_reason=choices[0].finish_reason if choices else c.finish_reason, choices=choices if keep else [],
        usage=ResultUsage(prompt_tokens=c.usage.prompt_tokens,
                          completion_tokens=0 if score_only else c.usage.completion_tokens,
                          cached_tokens=c.usage.cached_tokens,
                          reasoning_tokens=sum(o.reasoning_tokens for o in c.outputs)),
        timings=ResultTimings(submitted=job.created_at or None, started=started, first_token=c.timings.first_token,
                              finished=c.timings.finished or time.time()),
        worker=worker,
        # The engine fails a request only for what it is (too long, bad token ids): retrying won't help.
        error=ErrorInfo(code="invalid_request", message=c.error or "the engine refused the request") if failed else None,
    )


def _scored_only(o: CompletionOutput) -> CompletionOutput:
    """A max_tokens 0 request's output: the token the engine had to sample left out."""
    return replace(o, text="", token_ids=[], finish_reason="length", logprobs=[] if o.logprobs is not None else None)


def _choice(job: Job, o: Any, echo: str, decode: _Decoder, prompt_lps: list[TokenLogprob] | None) -> Choice:
    text, calls = o.text, None
    if job.tools and job.tool_choice != "none":
        text, calls = parse_tool_calls(text)
    reason = "tool_calls" if calls and o.finish_reason == "stop" else o.finish_reason
    logprobs = decode.logprobs(o.logprobs)
    if job.echo and prompt_lps is not None and logprobs is not None:
        # echo + logprobs: the prompt's tokens lead the logprobs as they lead the text (OpenAI's shape).
        logprobs, prompt_lps = prompt_lps + logprobs, None
    return Choice(index=o.index, text=echo + text, finish_reason=reason, logprobs=logprobs, tool_calls=calls,
                  reasoning=o.reasoning, prompt_logprobs=prompt_lps)


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]] | None]:
    """The Hermes / Qwen ``<tool_call>{"name", "arguments"}</tool_call>`` blocks of a reply, in OpenAI's
    shape, and the text around them. A block that is not a JSON call stays in the text."""
    calls: list[dict[str, Any]] = []

    def take(m: re.Match[str]) -> str:
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            return m.group(0)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return m.group(0)
        args = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}})
        return ""

    rest = _TOOL_CALL.sub(take, text).strip()
    return (rest, calls) if calls else (text, None)


def _prompt_text(job: Job, decode: _Decoder) -> str:
    if job.prompt is not None:
        return job.prompt
    tok = decode.tokenizer
    return tok.decode(job.prompt_token_ids or [], skip_special_tokens=True) if tok is not None else ""


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
        return [self.one(t) for t in lps if t is not None]

    def prompt_logprobs(self, lps: list[EngineLogprob | None] | None, ids: list[int]) -> list[TokenLogprob] | None:
        if lps is None:
            return None
        return [self.one(t) if t is not None else TokenLogprob(token_id=i, token=self.text(i), logprob=None)
                for t, i in zip(lps, ids, strict=True)]

    def one(self, t: EngineLogprob) -> TokenLogprob:
        return TokenLogprob(token_id=t.token_id, token=self.text(t.token_id), logprob=_finite(t.logprob),
                            top=[TopLogprob(token_id=i, token=self.text(i), logprob=_finite(lp)) for i, lp in t.top],
                            rank=t.rank)


def _finite(logprob: float) -> float:
    # A token a grammar masked out has logprob -inf, which JSON cannot carry; OpenAI writes -9999.0.
    return logprob if math.isfinite(logprob) else -9999.0
