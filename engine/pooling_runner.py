"""The pooling runner: which waiting inputs go into the next forward pass, and the pass itself.

An embedding input is one forward pass and no KV cache, so a step is a padded batch. Its cost is
``batch * longest``: the batch is chosen from inputs of nearly equal length (a length-sorted pool,
grown around the oldest waiting input, which therefore never starves) up to a token budget, and stops
growing before padding passes a tenth of it, so little of the work is padding.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch
from sluice.engine.embedding_model import EmbeddingModel


@dataclass
class Item:
    """One input of a request: ``request_id``'s ``index``-th vector."""

    seq: int  # arrival order, unique: the oldest waiting item anchors the next batch
    request_id: str
    index: int
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # a pair's segment ids (a cross-encoder's input), where the tokenizer has them


class LengthPool:
    """Waiting items, by arrival and by length."""

    def __init__(self) -> None:
        self.by_seq: dict[int, Item] = {}  # insertion order = arrival order
        self.keys: list[tuple[int, int]] = []  # (length, seq), sorted
        self.num_tokens = 0

    def __len__(self) -> int:
        return len(self.by_seq)

    def add(self, item: Item) -> None:
        self.by_seq[item.seq] = item
        bisect.insort(self.keys, (len(item.token_ids), item.seq))
        self.num_tokens += len(item.token_ids)

    def remove(self, item: Item) -> None:
        del self.by_seq[item.seq]
        key = (len(item.token_ids), item.seq)
        del self.keys[bisect.bisect_left(self.keys, key)]
        self.num_tokens -= len(item.token_ids)

    def take_batch(self, token_budget: int, max_items: int) -> list[Item]:
        """Items of nearly the oldest item's length whose padded batch fits ``token_budget`` (the oldest
        alone always does), removed from the pool, shortest first."""
        if not self.by_seq:
            return []
        oldest = next(iter(self.by_seq.values()))
        lo = bisect.bisect_left(self.keys, (len(oldest.token_ids), oldest.seq))
        lo, hi = grow_window([k[0] for k in self.keys], lo, token_budget, max_items)
        chosen = [self.by_seq[seq] for _, seq in self.keys[lo:hi]]
        del self.keys[lo:hi]
        for item in chosen:
            del self.by_seq[item.seq]
            self.num_tokens -= len(item.token_ids)
        return chosen


MAX_PADDING_SHARE = 0.1  # of a step's padded tokens, once it is past SMALL_STEP
SMALL_STEP = 512  # padded tokens below which padding is not worth a smaller batch


def grow_window(lengths: list[int], start: int, token_budget: int, max_items: int) -> tuple[int, int]:
    """Grow ``[start, start + 1)`` over sorted ``lengths`` to ``[lo, hi)`` while ``count * longest`` stays
    within ``token_budget`` and padding within MAX_PADDING_SHARE, each time taking the neighbour that adds
    the least padding."""
    lo, hi = start, start + 1
    longest, real = lengths[start], lengths[start]
    while hi - lo < max_items:
        count = hi - lo
        # A shorter neighbour pads itself up to ``longest``; a longer one pads everyone up to it.
        left = right = None
        if lo > 0 and _fits(count + 1, longest, real + lengths[lo - 1], token_budget):
            left = longest - lengths[lo - 1]
        if hi < len(lengths) and _fits(count + 1, lengths[hi], real + lengths[hi], token_budget):
            right = (lengths[hi] - longest) * count
        if left is None and right is None:
            break
        if right is None or (left is not None and left <= right):
            lo -= 1
            real += lengths[lo]
        else:
            longest = lengths[hi]
            real += longest
            hi += 1
    return lo, hi


def _fits(count: int, longest: int, real: int, token_budget: int) -> bool:
    padded = count * longest
    return padded <= token_budget and (padded <= SMALL_STEP or padded - real <= MAX_PADDING_SHARE * padded)


def run_batch(model: EmbeddingModel, items: list[Item]) -> torch.Tensor:
    """One forward pass over ``items`` (right-padded) -> their pooled vectors [len(items), dim], float32."""
    lengths = torch.tensor([len(it.token_ids) for it in items])
    pad = int(model.tokenizer.pad_token_id or 0)  # any id: padded positions are masked and never pooled
    ids = torch.full((len(items), int(lengths.max())), pad, dtype=torch.long)
    types = None if items[0].token_type_ids is None else torch.zeros_like(ids)
    for row, it in enumerate(items):
        ids[row, : len(it.token_ids)] = torch.tensor(it.token_ids, dtype=torch.long)
        if types is not None and it.token_type_ids is not None:
            types[row, : len(it.token_type_ids)] = torch.tensor(it.token_type_ids, dtype=torch.long)
    return model.embed(ids, lengths, types)
