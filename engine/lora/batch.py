"""The step's adapter layout: the batch put in adapter order, and the packed rows of each adapter's run."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def adapter_order(names: Sequence[str | None]) -> list[int] | None:
    """The order of the sequences (one adapter name each, None = the base) that puts each adapter's in one
    run: base first, then the adapters by name (so the step's stacked LoRA weights, engine/lora/layers.py,
    stay as they are while the same adapters run), stable within a run; None if they already lie so."""
    order = sorted(range(len(names)), key=lambda i: (names[i] is not None, names[i] or ""))
    return None if order == list(range(len(names))) else order


def adapter_runs(names: Sequence[str | None], q_lens: Sequence[int]) -> list[tuple[str, int, int]]:
    """Each run of consecutive sequences on one adapter as (adapter, first packed row, end row); sequence
    ``i`` owns ``q_lens[i]`` consecutive rows; base runs are left out. An adapter split over several runs
    (a batch not put in ``adapter_order``) has several entries: correct, only slower."""
    cu = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum(np.asarray(q_lens, dtype=np.int64), out=cu[1:])
    out: list[tuple[str, int, int]] = []
    start = 0
    for i in range(1, len(names) + 1):
        if i == len(names) or names[i] != names[start]:
            name = names[start]
            if name is not None:
                out.append((name, int(cu[start]), int(cu[i])))
            start = i
    return out
