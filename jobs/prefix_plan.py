"""Planning a batch by its shared prefixes (issue 44): jobs whose prompts begin alike are handed out
next to each other, so a prefix's KV is computed once and served from the prefix cache to the rest of
its group while it is still cached, instead of being evicted and recomputed when the batch's prefixes
arrive shuffled and the cache holds only some of them.

The key is the prompt as the chat template lays it out, in order: the adapter, the tools (templates
render them into the system turn, ahead of the messages), then each message's role and text. Sorting by
it puts jobs that share a longer prefix closer together (a depth-first walk of the prompts' trie), with
no tokenizer needed where jobs are submitted (the CLI, the API). Jobs with a deadline go first, earliest
first: a plan never makes a job miss its deadline for the sake of the cache. Priorities are not touched
(each priority is its own stream), nor is the output's order (results name their row or custom_id).

Affinity: each job of a planned run of shared prompts carries its prefix group (``groups``), so that
with several workers a group goes to the worker that took its first jobs (jobs/consumer/commands.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from typing import Any

from sluice.jobs.schemas import Job

PLAN_WINDOW = 4096  # jobs ordered together where they are read as a stream (a dataset's rows)
GROUP_MIN_CHARS = 256  # a shared prefix shorter than this (~64 tokens, 4 KV blocks) is not worth keeping together
_FIELD, _PART = "\x1e", "\x1f"  # separators no prompt text sorts around differently than its content


def prompt_key(job: Job) -> str:
    """Text two jobs share a prefix of when their prompts (as the engine will see them) begin alike."""
    head = [job.model or "", json.dumps(job.tools, sort_keys=True) if job.tools else ""]
    if job.messages is not None:
        body = [f"{m.get('role', '')}{_PART}{_content_text(m.get('content'))}" for m in job.messages]
    elif job.prompt_token_ids is not None:
        body = [",".join(map(str, job.prompt_token_ids))]
    elif job.prompts is not None:  # several prompts: the first is the one that runs first
        first = job.prompts[0]
        body = [first if isinstance(first, str) else ",".join(map(str, first))]
    else:
        body = [job.prompt or ""]
    return _FIELD.join(head + body)


def plan_key(job: Job) -> tuple[bool, float, str]:
    """Deadlines first (earliest first), then by prompt."""
    return (job.deadline is None, job.deadline or 0.0, prompt_key(job))


def plan(jobs: list[Job]) -> list[Job]:
    """``jobs`` in hand-out order (a stable sort: equal prompts keep their arrival order)."""
    return sorted(jobs, key=plan_key)


def planned(jobs: Iterable[Job], window: int = PLAN_WINDOW) -> Iterator[Job]:
    """``jobs`` read ``window`` at a time, each window in hand-out order: a stream of rows is planned
    without holding all of it."""
    held: list[Job] = []
    for job in jobs:
        held.append(job)
        if len(held) >= window:
            yield from plan(held)
            held = []
    yield from plan(held)


def groups(prompt_keys: list[str]) -> list[str]:
    """For prompt keys in hand-out order, each job's prefix group ('' for none): a run of neighbours that
    each share at least GROUP_MIN_CHARS with the next, cut where the shared part falls below half of the
    run's shortest so far (a common system prompt before many documents does not make one group of them
    all: each document's questions are a group). The id hashes the run's shared text, so a group has the
    same id wherever it appears."""
    shared = [_common(a, b) for a, b in zip(prompt_keys, prompt_keys[1:], strict=False)]
    out = [""] * len(prompt_keys)
    start = 0
    while start < len(prompt_keys):
        end, low = start, 0
        while end < len(shared) and shared[end] >= max(GROUP_MIN_CHARS, low // 2):
            low = shared[end] if end == start else min(low, shared[end])
            end += 1
        if end > start:
            gid = hashlib.blake2b(prompt_keys[start][:low].encode(), digest_size=8).hexdigest()
            out[start:end + 1] = [gid] * (end + 1 - start)
        start = end + 1
    return out


def _common(a: str, b: str) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]: halve by comparing slices (C speed)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: their text in order, anything else as JSON
        return "".join(p.get("text", "") if isinstance(p, dict) and p.get("type") == "text"
                       else json.dumps(p, sort_keys=True) for p in content)
    return "" if content is None else json.dumps(content, sort_keys=True)
