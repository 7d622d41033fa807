"""How many jobs to take now. The taking itself (XREADGROUP, XCLAIM) is jobs/consumer/commands.py's.

A worker holds at most ``max_num_seqs + lookahead`` jobs and asks for more only while its free KV
blocks can start them, plus a small look-ahead so the engine has a job to admit the moment blocks
free up. So several workers share a stream by what each can actually run, and none hoards.
"""

from __future__ import annotations

import math
import time

import redis

from jobs.consumer import commands as consumer

STREAMS_REFRESH = 1.0  # seconds a model's list of ready streams is reused


def default_lookahead(max_num_seqs: int) -> int:
    return max(2, math.ceil(0.1 * max_num_seqs))


class Puller:
    def __init__(self, queue: str, consumer_id: str, max_num_seqs: int, lookahead: int, block_size: int) -> None:
        self.queue = queue
        self.consumer = consumer_id
        self.max_num_seqs = max_num_seqs
        self.lookahead = lookahead
        self.avg_blocks = float(math.ceil(320 / block_size))  # a guess until real jobs are seen
        self._streams: list[tuple[str, float]] = []
        self._streams_at = -math.inf

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

    def read(self, r: redis.Redis, n: int) -> consumer.Pulled:
        """Up to ``n`` jobs never delivered before, from the best-scored ready streams first. The list
        is reused for a second, but re-read at once when it ran dry (new work may have come)."""
        now = time.monotonic()
        if now - self._streams_at > STREAMS_REFRESH or not self._streams:
            self._streams = consumer.ready(r, self.queue)
            self._streams_at = now
        got = consumer.read(r, self.queue, self.consumer, n, self._streams)
        if len(got.deliveries) < n:
            self._streams_at = -math.inf
        return got

    def claim(self, r: redis.Redis, n: int, held_entries: set[str]) -> consumer.Pulled:
        return consumer.claim(r, self.queue, self.consumer, n, held_entries)
