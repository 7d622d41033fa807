"""A Result rendered as a line of OpenAI's batch output (and error) file, and its response body."""

from __future__ import annotations

from typing import Any

from sluice.jobs.embeddings import decode_base64, embedding_response
from sluice.jobs.keys import DEFAULT_QUEUE
from sluice.jobs.responses import is_response, response_body
from sluice.jobs.schemas import Choice, ErrorInfo, Job, LineErrorInfo, Result, TokenLogprob
from sluice.jobs.scoring import SCORE_KINDS, scoring_body

# ---- rendering a Result as an OpenAI batch output line -----------------------------------------
_BATCH_ERROR_CODES = {"cancelled": "batch_cancelled", "expired": "batch_expired"}


def result_to_output_line(job: Job | None, result: Result) -> dict[str, Any]:
    """``{"id", "custom_id", "response", "error"}`` as in OpenAI's batch output and error files."""
    custom_id = job.custom_id if job is not None else result.custom_id
    line: dict[str, Any] = {"id": f"batch_req_{result.job_id}", "custom_id": custom_id, "response": None,
                            "error": None}
    if result.status == "completed":
        line["response"] = {"status_code": 200, "request_id": result.job_id, "body": completion_body(job, result)}
        return line
    err = result.error or ErrorInfo(code=result.status, message=f"request {result.status}")
    code = _BATCH_ERROR_CODES.get(result.status, err.code)
    line["error"] = {"code": code, "message": err.message}
    if result.status == "failed":
        status = 400 if err.code == "invalid_request" else 500
        line["response"] = {"status_code": status, "request_id": result.job_id,
                            "body": {"error": {"message": err.message, "type": "invalid_request_error"
                                               if status == 400 else "server_error", "code": err.code}}}
    return line


def line_error_to_output_line(info: LineErrorInfo, custom_id: str | None = None) -> dict[str, Any]:
    """A rejected input line as an error-file line (shaped as ``sluice generate`` writes them)."""
    return {"id": f"line-{info.line}", "custom_id": custom_id, "response": None,
            "error": {"code": info.code, "message": f"line {info.line}: {info.message}", "line": info.line}}


def completion_body(job: Job | None, result: Result) -> dict[str, Any]:
    """A chat.completion or text_completion object for a completed Result."""
    kind = job.kind if job is not None else result.kind
    if is_response(job, result):
        return response_body(result, job.model if job is not None else None)
    if kind == "embedding":
        return embedding_body(job, result)
    if kind in SCORE_KINDS:
        return scoring_body(kind, result.job_id, (job.model if job is not None else None) or result.model or DEFAULT_QUEUE,
                            result.scores or [], result.usage.prompt_tokens, int(result.timings.finished or 0))
    choices = result.choices or [Choice(index=0, text=result.text, finish_reason=result.finish_reason or "stop")]
    created = int(result.timings.finished or 0)
    u = result.usage
    usage = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
             "total_tokens": u.prompt_tokens + u.completion_tokens,
             "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
             "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens}}
    model = (job.model if job is not None else None) or result.model or DEFAULT_QUEUE
    if kind == "chat":
        out = [{"index": c.index, "message": _message(c), "logprobs": _chat_logprobs(c.logprobs),
                "finish_reason": _finish(c.finish_reason)} for c in choices]
        return {"id": f"chatcmpl-{result.job_id}", "object": "chat.completion", "created": created,
                "model": model, "choices": out, "usage": usage}
    texts: list[dict[str, Any]] = [{"index": c.index, "text": c.text, "logprobs": _completion_logprobs(c.logprobs),
                                    "finish_reason": _finish(c.finish_reason)} for c in choices]
    for o, c in zip(texts, choices, strict=True):
        if c.prompt_logprobs is not None:
            o["prompt_logprobs"] = _vllm_prompt_logprobs(c.prompt_logprobs)
    return {"id": f"cmpl-{result.job_id}", "object": "text_completion", "created": created, "model": model,
            "choices": texts, "usage": usage}


def embedding_body(job: Job | None, result: Result) -> dict[str, Any]:
    """OpenAI's CreateEmbeddingResponse for a completed embedding Result."""
    model = (job.model if job is not None else None) or result.model or DEFAULT_QUEUE
    vectors = [decode_base64(v) for v in result.embeddings or []]
    return embedding_response(vectors, model, result.usage.prompt_tokens, result.encoding_format)


def _message(c: Choice) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.reasoning is not None:
        # vLLM's field, and its newer name; a reply cut inside its thinking has no answer (content null).
        msg.update(content=c.text or None, reasoning_content=c.reasoning, reasoning=c.reasoning)
    if c.tool_calls:
        msg.update(content=c.text or None, tool_calls=c.tool_calls)
    return msg


def _finish(reason: str | None) -> str:
    # stop | length | tool_calls; an aborted or failed sample keeps its own reason ("abort", "error").
    return reason or "stop"


def _chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if lps is None:
        return None

    def entry(token: str, logprob: float | None) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(x.token, x.logprob) for x in t.top]}
                        for t in lps]}


def _completion_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI's completions logprobs; with echo, the prompt's tokens lead (the first with null logprobs,
    as OpenAI wrote it: nothing came before it)."""
    if lps is None:
        return None
    entries = lps
    offsets, pos = [], 0
    for t in entries:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in entries], "token_logprobs": [t.logprob for t in entries],
            "top_logprobs": [{x.token: x.logprob for x in t.top} if t.logprob is not None else None for t in entries],
            "text_offset": offsets}


def _vllm_prompt_logprobs(lps: list[TokenLogprob]) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}} for it and its top-k."""
    def entry(t: TokenLogprob) -> dict[str, Any]:
        out = {str(x.token_id): {"logprob": x.logprob, "rank": r, "decoded_token": x.token}
               for r, x in enumerate(t.top, 1)}
        out.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.token})
        return out

    return [entry(t) if t.logprob is not None else None for t in lps]
