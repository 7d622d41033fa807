"""A full job server: Redis at ``maxmemory`` (``noeviction``) refuses every write that needs memory with an
OOM error reply. Every path that writes on a client's behalf (a batch, a job, an online request's
admission, a cancel) runs inside ``refused_when_full``, so the refusal is one error, ``JobServerFull``,
wherever it comes from: the CLI exits with its job-server code, the API answers 507 ``job_server_full``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis

NOTHING_QUEUED = "nothing was queued"  # what a refused submission or admission kept
CANCEL_REFUSED = "the cancel may be incomplete: send it again once memory frees"  # its writes are several


class JobServerFull(redis.ResponseError):
    """Redis refused a write for lack of memory: what the caller asked for was not kept (``undo`` took back
    any part of it that was written); retry once memory frees."""


def is_full(e: BaseException) -> bool:
    # A plain command's, a pipeline's and a script's OOM reply all parse as OutOfMemoryError; the text is
    # for a server or proxy that words its prefix otherwise.
    return isinstance(e, redis.exceptions.OutOfMemoryError) or (
        isinstance(e, redis.ResponseError) and "maxmemory" in str(e))


@contextmanager
def refused_when_full(what: str, undo: Callable[[], None] | None = None) -> Iterator[None]:
    """An OOM refusal inside the block becomes ``JobServerFull`` saying ``what`` (e.g. "nothing was
    queued"), after ``undo()`` took back what the block had written (deletes are allowed when full)."""
    try:
        yield
    except JobServerFull:
        raise  # an inner block said it already
    except redis.ResponseError as e:
        if not is_full(e):
            raise
        if undo is not None:
            undo()
        raise JobServerFull(f"the job server is full (Redis maxmemory reached); {what}: {e}") from None
