"""Checks of uploaded batch files and single jobs, before anything is queued.

As with ``sluice submit``: a file with some bad lines is taken, its good lines run and its bad lines go to
the batch's error file with their line numbers (the upload remembers them). A file with no good line is
refused whole (400), the error naming the first bad line and listing up to ``MAX_REPORTED`` of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO

from sluice.api.errors import ApiError
from sluice.jobs.embeddings import EMBEDDINGS_URL
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.responses import RESPONSES_URL
from sluice.jobs.schemas import CHAT_URL, COMPLETIONS_URL, Job, LineErrorInfo
from sluice.jobs.scoring import KIND_URLS, score_chars

MAX_REPORTED = 20


def job_endpoint(job: Job) -> str:
    if job.api == "responses":
        return RESPONSES_URL
    return {"chat": CHAT_URL, "embedding": EMBEDDINGS_URL, **KIND_URLS}.get(job.kind, COMPLETIONS_URL)


def prompt_chars(job: Job) -> int:
    """The size the prompt limit applies to: characters of text, or a count of token ids."""
    if job.messages is not None:
        return sum(_content_chars(m["content"]) for m in job.messages)
    if job.score is not None:
        return score_chars(job.score)
    if job.input is not None:  # an embedding job: a string, strings, token ids, or lists of them
        items = [job.input] if isinstance(job.input, str) else job.input
        return sum(len(x) if isinstance(x, str | list) else 1 for x in items)
    if job.prompts is not None:  # several prompts: the limit is on them all
        return sum(len(p) for p in job.prompts)
    return len(job.prompt) if job.prompt is not None else len(job.prompt_token_ids or ())


def _content_chars(content: str | list[dict[str, str]]) -> int:
    """Characters of text; an image part counts none (its size is the worker's limit, and the line's)."""
    return len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)


def named_model(job: Job) -> str | None:
    """The model a job names; "default" names none."""
    return job.model if job.model not in (None, "default") else None


def check_job(job: Job, max_prompt_chars: int) -> None:
    n = prompt_chars(job)
    if n > max_prompt_chars:
        raise LineError(job.line, "prompt_too_long", f"the prompt has {n} characters; the limit is {max_prompt_chars}")


@dataclass
class FileScan:
    """What a valid batch file holds: its requests, the model and endpoint they name."""

    lines: int = 0
    model: str | None = None
    endpoint: str | None = None
    errors: list[LineErrorInfo] = field(default_factory=list)  # every bad line
    error_count: int = 0
    _seen: set[str] = field(default_factory=set)

    def add(self, line_no: int, raw: bytes, max_prompt_chars: int) -> None:
        try:
            job = parse_line(_decode(line_no, raw), line_no)
            check_job(job, max_prompt_chars)
            self._check_consistent(job)
        except LineError as e:
            self.error_count += 1
            self.errors.append(e.info())
            return
        self._seen.add(job.custom_id)

    def _check_consistent(self, job: Job) -> None:
        if job.custom_id in self._seen:
            raise LineError(job.line, "duplicate_custom_id", f"custom_id {job.custom_id!r} appears twice")
        model, endpoint = named_model(job), job_endpoint(job)
        if model is not None and self.model is not None and model != self.model:
            raise LineError(job.line, "model_mismatch", f"model {model!r} differs from {self.model!r} on earlier lines")
        if self.endpoint is not None and endpoint != self.endpoint:
            raise LineError(job.line, "mixed_endpoints", f"a {endpoint} request after {self.endpoint} ones "
                            "(a batch is for one endpoint)")
        self.model = self.model or model
        self.endpoint = self.endpoint or endpoint

    def raise_if_bad(self) -> None:
        """Refuse a file none of whose lines can run."""
        if not self.errors or self.error_count < self.lines:
            return
        first = self.errors[0]
        more = f" ({self.error_count - 1} more bad lines)" if self.error_count > 1 else ""
        raise ApiError(400, f"no line of the file can run: line {first.line}: {first.message}{more}",
                       code=first.code, param="file", line=first.line,
                       lines=[e.model_dump() for e in self.errors[:MAX_REPORTED]])


def _decode(line_no: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LineError(line_no, "invalid_encoding", f"not UTF-8 (byte {e.start + 1})") from None


def max_line_bytes(max_prompt_chars: int) -> int:
    """The longest line worth parsing: the prompt at 6 bytes a character (a JSON \\u escape) plus the rest."""
    return 6 * max_prompt_chars + (1 << 20)


def bounded_lines(src: IO[bytes], limit: int) -> Iterator[bytes]:
    """The lines of ``src``, refusing (400) one longer than ``limit`` bytes before it is read whole."""
    for line_no in itertools.count(1):
        raw = src.readline(limit + 1)
        if not raw:
            return
        if len(raw) > limit and not raw.endswith(b"\n"):
            raise ApiError(400, f"line {line_no}: longer than {limit} bytes", code="line_too_long", param="file",
                           line=line_no)
        yield raw


def scan_lines(lines: Iterable[bytes], max_lines: int, max_prompt_chars: int) -> FileScan:
    """Every non-blank line checked as ``submit`` will parse it; raises a 400 ApiError naming bad lines."""
    scan = FileScan()
    for line_no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        scan.lines += 1
        if scan.lines > max_lines:
            raise ApiError(400, f"line {line_no}: more than {max_lines} requests in one batch file",
                           code="too_many_lines", param="file", line=line_no)
        scan.add(line_no, raw, max_prompt_chars)
    scan.raise_if_bad()
    if scan.lines == 0:
        raise ApiError(400, "the file holds no requests", code="empty_file", param="file")
    return scan
