"""Multimodal rotary positions (M-RoPE: Qwen2-VL, Qwen2.5-VL): three position ids per token, t/h/w.

A text token's three ids are equal and count on by one. An image's tokens take its merged patch grid's
coordinates, offset by the position where the image starts; the text after it continues one past the
largest of them. So a prompt with images is shorter in positions than in tokens, and every token after
the prompt sits at its index + ``delta`` (negative) on all three rows.

The prompt's table is computed once per request at admission, from its token ids and each image's grid,
and kept with the sequence (its n samples share it): a chunk of prefill takes its slice, a re-admission
after preemption takes it again, a decode step needs only index + delta. The decoder's own rotary
(transformers' module) splits its frequencies over the three rows by ``mrope_section``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, eq=False)
class MRopePositions:
    table: np.ndarray  # [3, num_prompt_tokens] int64: each prompt token's t/h/w position
    delta: int  # a token at index i past the prompt is at position i + delta on every row

    def rows(self, start: int, end: int) -> np.ndarray:
        """The [3, end - start] positions of token indices [start, end)."""
        n = self.table.shape[1]
        tail = np.arange(max(start, n), end, dtype=np.int64) + self.delta
        head = self.table[:, start:min(end, n)]
        return np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1) if len(tail) else head


def uses_mrope(config: Any) -> bool:
    """Whether the model's decoder rotates by three position rows (its rope parameters name mrope sections)."""
    text = config.get_text_config()
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return isinstance(rope, dict) and rope.get("mrope_section") is not None


def prompt_positions(num_tokens: int, images: list[tuple[int, int, tuple[int, int, int]]]) -> MRopePositions:
    """The table of a prompt of ``num_tokens`` tokens whose images are (first token, token count, merged grid
    t/h/w), in prompt order, each a contiguous run of tokens."""
    table = np.empty((3, num_tokens), dtype=np.int64)
    index = position = 0  # the next token to place, and the next free position
    for first, count, (t, h, w) in images:
        if t * h * w != count or first < index:
            raise ValueError(f"an image's {count} tokens at {first} do not match its {t}x{h}x{w} grid")
        table[:, index:first] = np.arange(first - index) + position
        position += first - index
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")).reshape(3, -1)
        table[:, first:first + count] = grid + position
        position += max(t, h, w)
        index = first + count
    table[:, index:] = np.arange(num_tokens - index) + position
    position += num_tokens - index
    return MRopePositions(table, position - num_tokens)


def step_positions(seqs: list[Any], starts: np.ndarray, ends: np.ndarray, flat: np.ndarray) -> np.ndarray | None:
    """A step's [3, T] positions when a sequence in it has an M-RoPE table, else None (``flat`` serves).
    The other sequences' three rows are their plain positions."""
    if all(s.mrope is None for s in seqs):
        return None
    out = np.broadcast_to(flat, (3, len(flat))).copy()
    offset = 0
    for seq, start, end in zip(seqs, starts.tolist(), ends.tolist(), strict=True):
        if seq.mrope is not None:
            out[:, offset:offset + end - start] = seq.mrope.rows(start, end)
        offset += end - start
    return out


def decode_deltas(seqs: list[Any]) -> np.ndarray:
    """Each sequence's delta (0 without a table): a decode token's one position is its index + delta."""
    return np.fromiter((s.mrope.delta if s.mrope is not None else 0 for s in seqs), dtype=np.int64, count=len(seqs))


def in_prompt(seqs: list[Any]) -> bool:
    """Whether a sequence with a table still computes prompt tokens, whose three rows may differ: such a step
    needs the [3, T] positions, never a decode graph's one row."""
    return any(s.mrope is not None and s.num_computed_tokens < s.num_prompt_tokens for s in seqs)
