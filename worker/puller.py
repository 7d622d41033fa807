"""How many jobs to take now. The taking itself is the consumer session's (jobs/consumer/session.py).

A worker holds at most ``max_num_seqs + lookahead`` jobs and asks for more only while its free KV
blocks can start them, plus a small look-ahead so the engine has a job to admit the moment blocks
free up. So several workers share a stream by what each can actually run, and none hoards.
"""

from __future__ import annotations

import math


def default_lookahead(max_num_seqs: int) -> int:
    return max(2, math.ceil(0.1 * max_num_seqs))


class Puller:
    def __init__(self, max_num_seqs: int, lookahead: int, block_size: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.lookahead = lookahead
        self.avg_blocks = float(math.ceil(320 / block_size))  # a guess until real jobs are seen

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
