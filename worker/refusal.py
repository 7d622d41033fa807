"""A worker whose model can never run (an encoder-decoder, an architecture no model path has) fails the
jobs waiting on its queue with the reason, rather than leaving them to wait for a worker that never comes.

Only when no live worker serves the queue: one that does may run those jobs (a shared ``--queue``).
Jobs added after the queue was read wait as before. Each outcome goes through the same atomic record
as any other (jobs/consumer/commands.py), so a job gets exactly one even if a cancel or another worker races it.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import redis

from jobs.consumer import commands as consumer
from jobs.consumer import outcomes
from jobs.consumer.link import Link
from jobs.consumer.outbox import REDIS_DOWN, WriteHeld, Writer
from jobs.store import served_queues
from worker.options import WorkerOptions

log = logging.getLogger(__name__)

REFUSED = "unsupported_model"  # the error code of the failed results
CHUNK = 256  # jobs taken per round trip


def fail_waiting_jobs(opts: WorkerOptions, reason: str) -> int:
    """Give every job now waiting on ``opts.queue`` a failed outcome naming ``reason``; how many got one.
    Redis trouble is logged, not raised: the worker exits on the refusal either way."""
    name = f"{opts.worker_id or socket.gethostname()}/refused-{os.getpid()}"  # no heartbeat: claimable if we die
    try:
        link = Link(opts.redis_url)
    except (OSError, RuntimeError, redis.RedisError) as e:
        log.error("cannot reach the job server to fail the jobs waiting on %r: %s", opts.queue, e)
        return 0
    try:
        if opts.queue in served_queues(link.r):
            log.warning("another live worker serves queue %r: its waiting jobs are left to it", opts.queue)
            return 0
        n = _fail_all(link, opts.queue, name, reason)
    except (*REDIS_DOWN, redis.RedisError, WriteHeld) as e:
        log.error("failing the jobs waiting on %r stopped: %s (the rest wait for another worker)", opts.queue, e)
        return 0
    finally:
        link.r.close()
    if n:
        log.error("failed the %d jobs waiting on queue %r (%s): %s", n, opts.queue, REFUSED, reason)
    return n


def _fail_all(link: Link, queue: str, name: str, reason: str) -> int:
    """New jobs and the pending ones of dead workers, a chunk at a time, until none is left."""
    writer = Writer()
    seen: set[str] = set()  # entries handled: not claimed again should their write have been dropped
    failed = 0
    while True:
        got = consumer.claim(link.r, queue, name, CHUNK, seen)
        more = consumer.read(link.r, queue, name, CHUNK, consumer.ready(link.r, queue))
        got.deliveries += more.deliveries
        got.unreadable += more.unreadable
        if not got.deliveries and not got.unreadable:
            return failed
        seen.update(u.entry_id for u in got.unreadable)
        for o in outcomes.unreadables(link.r, got, name, queue):
            writer.add(o)
        for d in got.deliveries:
            seen.add(d.entry_id)
            writer.add(outcomes.settled(d, "failed", REFUSED, reason, name, queue))
        failed += sum(w.fresh for w in writer.flush(link.r, link.scripts, time.time()))
