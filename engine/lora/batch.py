"""The step's adapter index: which rows of the packed token batch belong to which adapter."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def adapter_rows(names: Sequence[str | None], q_lens: Sequence[int]) -> dict[str, np.ndarray]:
    """For each adapter among ``names`` (one per sequence, None = the base), the packed rows of its
    sequences' tokens (sequence ``i`` owns ``q_lens[i]`` consecutive rows), in order."""
    seq_of_row = np.repeat(np.arange(len(names)), np.asarray(q_lens, dtype=np.int64))
    out: dict[str, np.ndarray] = {}
    for name in dict.fromkeys(n for n in names if n is not None):
        mine = np.fromiter((n == name for n in names), dtype=bool, count=len(names))
        out[name] = np.flatnonzero(mine[seq_of_row])
    return out


def as_index(rows: np.ndarray, device: torch.device) -> slice | torch.Tensor:
    """Rows as a slice where they are one ascending run (a view, no gather), else an index tensor on
    ``device``."""
    first = int(rows[0])
    if np.array_equal(rows, np.arange(first, first + len(rows))):
        return slice(first, first + len(rows))
    return torch.from_numpy(rows).to(device)
