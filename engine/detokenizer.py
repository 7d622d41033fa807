"""Incremental detokenisation with stop strings.

Decoding a growing window of ids and emitting only what is new keeps a character whose bytes span
several tokens from coming out half-made: while the window's text ends in U+FFFD the emission waits.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens kept as context so that the first output token decodes as it would mid-text.
_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.prefix_offset = max(len(prompt_ids) - _CONTEXT, 0)
        self.read_offset = len(prompt_ids)
        self.text = ""
        self.stopped = False  # the text was cut at a stop string: nothing more is to be added

    def update(self, token_ids: list[int]) -> bool:
        """Take in the ids so far (prompt + output); return True if a stop string has appeared."""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return False
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        self.text += delta
        return self._check_stop(len(delta))

    def finish(self, token_ids: list[int]) -> None:
        """Flush text held back at the end (a last token that decodes to a partial character)."""
        if not self.stopped and self.read_offset < len(token_ids):
            prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(token_ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(token_ids)

    def _check_stop(self, delta_len: int) -> bool:
        if not self.stop:
            return False
        # Only the new text, and a stop string's length before it, can hold a new match.
        start = max(len(self.text) - delta_len - self.max_stop_len + 1, 0)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
