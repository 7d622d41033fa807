"""Text of streaming jobs as it is generated: after each step, each sample's new text, for the session
to publish (jobs/interactive.py). The engine only hands back token ids so far; they are detokenized
here, incrementally, as the engine does it for the final text, so the pieces add up to its prefix.

Text that may still turn out to be part of a stop string is held back (the engine cuts the final text
there); jobs whose final text is rewritten (tool calls parsed out, an echoed prompt) send none: their
stream carries the result alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.protocol import Engine
from sluice.jobs.consumer.commands import Delivery


def streams_text(d: Delivery) -> bool:
    job = d.job
    return bool(job.stream) and not job.echo and not (job.tools and job.tool_choice != "none")


@dataclass
class _Sample:
    detok: IncrementalDetokenizer
    seen: int = 0  # token ids read so far
    sent: int = 0  # characters published so far


@dataclass
class _Live:
    d: Delivery
    hold: int  # characters held back: the longest stop string
    first_index: int = 0  # its first sample's choice index (a list prompt's later prompts come after)
    samples: dict[int, _Sample] = field(default_factory=dict)


class TextStreams:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.live: dict[str, _Live] = {}  # engine request id -> its stream

    def __bool__(self) -> bool:
        return bool(self.live)

    def add(self, rid: str, d: Delivery, first_index: int = 0) -> None:
        if streams_text(d):
            self.live[rid] = _Live(d, max((len(s) for s in d.job.params.stop), default=0), first_index)

    def discard(self, rid: str | None) -> None:
        if rid is not None:
            self.live.pop(rid, None)

    def step(self, llm: Engine) -> list[tuple[Delivery, int, str]]:
        """The new text of every live stream since the last call."""
        out = []
        for rid, live in self.live.items():
            got = llm.tokens_so_far(rid)
            if got is None:
                continue
            n_prompt, samples = got
            for i, ids in enumerate(samples):
                text = self._new_text(live, i, n_prompt, ids)
                if text:
                    out.append((live.d, live.first_index + i, text))
        return out

    def _new_text(self, live: _Live, i: int, n_prompt: int, ids: list[int]) -> str:
        s = live.samples.get(i)
        if s is None:
            s = live.samples[i] = _Sample(IncrementalDetokenizer(self.tokenizer, ids[:n_prompt], []), n_prompt)
        if len(ids) == s.seen:
            return ""
        s.seen = len(ids)
        s.detok.update(ids)
        end = len(s.detok.text) - live.hold
        if end <= s.sent:
            return ""
        text, s.sent = s.detok.text[s.sent:end], end
        return text
