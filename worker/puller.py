"""How many jobs to take now, and taking them: new ones with XREADGROUP, orphans with XCLAIM.

A worker holds at most ``max_num_seqs + lookahead`` jobs and asks for more only while its free KV
blocks can start them, plus a small look-ahead so the engine has a job to admit the moment blocks
free up. So several workers share a stream by what each can actually run, and none hoards.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import redis
from pydantic import ValidationError

from jobs import keys
from jobs.schemas import Job

log = logging.getLogger(__name__)

EXHAUSTED_RECHECK = 2.0  # seconds before a stream that had nothing new is read again
STREAMS_REFRESH = 1.0  # seconds a model's list of job streams is reused
MAX_STREAMS = 256  # job streams looked at per read, best score first


@dataclass
class Delivery:
    job: Job
    stream: str
    entry_id: str
    deliveries: int  # times this job was handed to a worker, this time included


def default_lookahead(max_num_seqs: int) -> int:
    return max(2, math.ceil(0.1 * max_num_seqs))


class Puller:
    def __init__(self, queue: str, consumer: str, max_num_seqs: int, lookahead: int, block_size: int) -> None:
        self.queue = queue
        self.consumer = consumer
        self.max_num_seqs = max_num_seqs
        self.lookahead = lookahead
        self.avg_blocks = float(math.ceil(320 / block_size))  # a guess until real jobs are seen
        self._streams: list[str] = []
        self._streams_at = -math.inf
        self._exhausted: dict[str, float] = {}  # stream -> monotonic time to look again

    @property
    def max_held(self) -> int:
        return self.max_num_seqs + self.lookahead

    @property
    def min_pull(self) -> int:
        """While the engine still has jobs waiting, pull only this many or more at a time (fewer round trips)."""
        return max(1, self.lookahead // 2)

    def budget(self, held: int, running: int, waiting: int, free_blocks: int) -> int:
        """Jobs to ask for now: as many as can start (slots and blocks), plus the look-ahead, minus
        those already waiting; never more than ``max_held`` in all."""
        slots = max(0, self.max_num_seqs - running)
        by_blocks = max(0.0, free_blocks - waiting * self.avg_blocks) // max(self.avg_blocks, 1.0)
        fit = min(slots, int(by_blocks))
        return max(0, min(self.max_held - held, fit + self.lookahead - waiting))

    def observe(self, blocks: int) -> None:
        """A pulled job's KV need (blocks for prompt + max_tokens), to estimate the next ones'."""
        self.avg_blocks += 0.1 * (blocks - self.avg_blocks)

    # ---- reading ---------------------------------------------------------------------------------
    def streams(self, r: redis.Redis) -> list[str]:
        now = time.monotonic()
        if now - self._streams_at > STREAMS_REFRESH:
            self._streams = r.zrange(keys.active_streams(self.queue), 0, MAX_STREAMS - 1)
            self._streams_at = now
        return self._streams

    def read(self, r: redis.Redis, n: int) -> list[Delivery]:
        """Up to ``n`` jobs never delivered before, from the best-scored streams first."""
        out: list[Delivery] = []
        now = time.monotonic()
        for stream in self.streams(r):
            if len(out) >= n:
                break
            if self._exhausted.get(stream, 0.0) > now:
                continue
            try:
                got = r.xreadgroup(keys.GROUP, self.consumer, {stream: ">"}, count=n - len(out))
            except redis.ResponseError as e:  # the batch was deleted since the list was read
                log.debug("skipping %s: %s", stream, e)
                self._exhausted[stream] = now + EXHAUSTED_RECHECK
                continue
            entries = got[0][1] if got else []
            if not entries:
                self._exhausted[stream] = now + EXHAUSTED_RECHECK
            out.extend(d for d in (_delivery(r, stream, eid, f, 1) for eid, f in entries) if d is not None)
        return out

    def claim(self, r: redis.Redis, n: int, held_entries: set[str]) -> list[Delivery]:
        """Up to ``n`` pending jobs of workers whose heartbeat is gone (not merely idle: a long
        generation looks idle), and our own that we do not hold (left from before a restart)."""
        out: list[Delivery] = []
        for stream in self.streams(r):
            if len(out) >= n:
                break
            try:
                consumers = r.xinfo_consumers(stream, keys.GROUP)
            except redis.ResponseError:  # the batch was deleted since the list was read
                continue
            for c in consumers:
                name = c["name"]
                if c["pending"] and (name == self.consumer or not r.exists(keys.heartbeat(name))):
                    out.extend(self._claim_from(r, stream, name, n - len(out), held_entries))
        return out

    def _claim_from(self, r: redis.Redis, stream: str, owner: str, n: int, held: set[str]) -> list[Delivery]:
        if n <= 0:
            return []
        pending = [p for p in r.xpending_range(stream, keys.GROUP, "-", "+", n + len(held), consumername=owner)
                   if p["message_id"] not in held][:n]
        if not pending:
            return []
        # XCLAIM with the smallest idle time seen is a compare-and-set: an entry someone else claimed
        # in between has a smaller idle time now and is left alone.
        min_idle = min(p["time_since_delivered"] for p in pending)
        counts = {p["message_id"]: p["times_delivered"] + 1 for p in pending}
        claimed = r.xclaim(stream, keys.GROUP, self.consumer, min_idle, [p["message_id"] for p in pending])
        out = [_delivery(r, stream, eid, f, counts[eid]) for eid, f in claimed if f is not None]
        if out:
            log.info("claimed %d jobs of %s from %s", len(out), owner, stream)
        return [d for d in out if d is not None]


def _delivery(r: redis.Redis, stream: str, entry_id: str, fields: dict[str, str], count: int) -> Delivery | None:
    try:
        job = Job.model_validate_json(fields["j"])
    except (KeyError, ValidationError) as e:
        # Nothing to run and no job index to record an outcome under: drop it, or it comes back forever.
        log.error("dropping unreadable job %s in %s: %s", entry_id, stream, e)
        r.xack(stream, keys.GROUP, entry_id)
        r.xdel(stream, entry_id)
        return None
    return Delivery(job, stream, entry_id, count + int(fields.get("a") or 0))
