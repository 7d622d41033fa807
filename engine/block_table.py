"""The step's block tables, kept in one persistent array across steps.

Each scheduled sequence owns a row. A sequence's block table only grows while it runs (a block is
appended every ``block_size`` tokens), so a step copies just the new entries into the row; a row is
rewritten whole only when the sequence's table was replaced (admission or preemption give it a new
list). Sequences not scheduled in a step give their rows back.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sluice.engine.sequence import Sequence


@dataclass
class _Row:
    index: int
    source: list[int]  # the sequence's block_table list this row mirrors
    written: int  # how many of its entries are in the row


class BlockTableRows:
    def __init__(self, capacity: int = 16, width: int = 16) -> None:
        self.table = np.zeros((capacity, width), dtype=np.int32)
        self._rows: dict[int, _Row] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def rows_for(self, seqs: list[Sequence]) -> np.ndarray:
        """Bring the rows of ``seqs`` up to date; return their indices into ``table``, in order."""
        old, self._rows = self._rows, {}
        for seq in seqs:  # rows of sequences that left are free before any new one is handed out
            if seq.seq_id in old:
                self._rows[seq.seq_id] = old.pop(seq.seq_id)
        self._free.extend(r.index for r in old.values())
        longest = max((len(s.block_table) for s in seqs), default=0)
        if longest > self.table.shape[1]:
            self.table = np.pad(self.table, ((0, 0), (0, max(longest, 2 * self.table.shape[1]) - self.table.shape[1])))
        indices = np.empty(len(seqs), dtype=np.int64)
        for i, seq in enumerate(seqs):
            row = self._rows.get(seq.seq_id)
            if row is None or row.source is not seq.block_table:
                row = self._rows[seq.seq_id] = _Row(row.index if row else self._take(), seq.block_table, 0)
            n = len(seq.block_table)
            if n > row.written:
                self.table[row.index, row.written : n] = seq.block_table[row.written :]
                row.written = n
            indices[i] = row.index
        return indices

    def _take(self) -> int:
        if not self._free:
            grow = self.table.shape[0]
            self.table = np.pad(self.table, ((0, grow), (0, 0)))
            self._free = list(range(2 * grow - 1, grow - 1, -1))
        return self._free.pop()
