"""A worker whose model can never run (an encoder-decoder, an architecture no model path has) fails the
jobs waiting on its queue with the reason, rather than leaving them to wait for a worker that never comes.

Only when no live worker serves the queue: one that does may run those jobs (a shared ``--queue``).
Jobs added after the queue was read wait as before. Each outcome goes through the same atomic record
as any other (jobs/consumer/), so a job gets exactly one even if a cancel or another worker races it.
"""

from __future__ import annotations

import logging
import os
import socket

from sluice.jobs.consumer.session import CONNECT_ERRORS, JOB_SERVER_ERRORS, ConsumerSession, SessionSettings
from sluice.worker.options import WorkerOptions

log = logging.getLogger(__name__)

REFUSED = "unsupported_model"  # the error code of the failed results
CHUNK = 256  # jobs taken per round trip


def fail_waiting_jobs(opts: WorkerOptions, reason: str) -> int:
    """Give every job now waiting on ``opts.queue`` a failed outcome naming ``reason``; how many got one.
    Redis trouble is logged, not raised: the worker exits on the refusal either way."""
    name = f"{opts.worker_id or socket.gethostname()}/refused-{os.getpid()}"  # no heartbeat: claimable if we die
    try:
        session = ConsumerSession(opts.queue, name, True, opts.redis_url, SessionSettings(), dict, register=False)
    except CONNECT_ERRORS as e:
        log.error("cannot reach the job server to fail the jobs waiting on %r: %s", opts.queue, e)
        return 0
    try:
        if session.serves_elsewhere():
            log.warning("another live worker serves queue %r: its waiting jobs are left to it", opts.queue)
            return 0
        n = _fail_all(session, reason)
    except JOB_SERVER_ERRORS as e:
        log.error("failing the jobs waiting on %r stopped: %s (the rest wait for another worker)", opts.queue, e)
        return 0
    finally:
        session.close()
    if n:
        log.error("failed the %d jobs waiting on queue %r (%s): %s", n, opts.queue, REFUSED, reason)
    return n


def _fail_all(session: ConsumerSession, reason: str) -> int:
    """New jobs and the pending ones of dead workers, a chunk at a time, until none is left."""
    seen: set[str] = set()  # entries handled: not taken again should their write have been dropped
    failed = 0
    while True:
        before = len(seen)
        for d in session.take_waiting(CHUNK, seen):
            session.settle(d, "failed", REFUSED, reason)
        if len(seen) == before:
            return failed
        failed += session.write_now()
