"""Reasoning models: where a reply's thinking is, the grammar and the budget around it, and the split of
a finished reply into its thinking and its answer.

A thinking model writes its trace between two delimiter tokens (``<think>`` ... ``</think>`` for Qwen3
and DeepSeek-R1). ``reasoning_parser="auto"`` finds a known pair as single tokens in the tokenizer's
vocabulary; a name from ``PARSERS`` picks one where that cannot tell; ``"none"`` turns the split off.
Only chat requests are split (a raw prompt is the caller's own format).

A sequence thinks from its first output token when the prompt leaves a think block open (DeepSeek-R1's
template ends the prompt with ``<think>``), or, when the prompt has no think block, if its first token is
the start delimiter (Qwen3 opens it itself); a prompt that closes a block (Qwen3 with
``enable_thinking: false`` closes an empty one) is answered straight away. While it thinks, a structured output waits (its grammar starts after the end
delimiter) and, past ``max_reasoning_tokens`` thinking tokens, the end delimiter is forced.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Any

from sluice.engine.outputs import CompletionOutput, Request
from sluice.engine.sequence import Sequence

# vLLM's parser names for the delimiter pairs they use.
PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
    "seed_oss": ("<seed:think>", "</seed:think>"),
}


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str
    end: str
    start_id: int
    end_id: int


def find_parser(tokenizer: Any, name: str = "auto") -> ReasoningParser | None:
    """The think delimiters of ``tokenizer``: ``name`` auto | none | a key of ``PARSERS``. ValueError when a
    named parser's delimiters are not single tokens of this tokenizer."""
    if name == "none":
        return None
    if name != "auto" and name not in PARSERS:
        raise ValueError(f"reasoning_parser must be auto, none or one of {sorted(PARSERS)}, not {name!r}")
    vocab = tokenizer.get_vocab()  # added tokens included
    for key in (name,) if name != "auto" else tuple(PARSERS):
        start, end = PARSERS[key]
        start_id, end_id = vocab.get(start), vocab.get(end)
        if start_id is not None and end_id is not None:
            return ReasoningParser(key, start, end, start_id, end_id)
        if name != "auto":
            raise ValueError(f"reasoning parser {name!r}: {start!r} and {end!r} are not single tokens of this tokenizer")
    return None


class Phase(Enum):
    BEFORE = auto()  # nothing generated yet: the first token may open the thinking
    THINKING = auto()
    ANSWER = auto()


@dataclass
class ThinkState:
    """One sequence's place in its reply: before, in or after the thinking."""

    start_id: int
    end_id: int
    budget: int | None  # max_reasoning_tokens
    phase: Phase
    num_thinking: int = 0  # thinking tokens so far, the start delimiter included

    @property
    def thinking(self) -> bool:
        return self.phase is Phase.THINKING

    @property
    def may_start(self) -> bool:
        return self.phase is Phase.BEFORE

    def must_end(self) -> bool:
        return self.thinking and self.budget is not None and self.num_thinking >= self.budget

    def advance(self, token: int) -> bool:
        """Take a sampled token; True when it belongs to the thinking (delimiters included)."""
        if self.phase is Phase.BEFORE:
            self.phase = Phase.THINKING if token == self.start_id else Phase.ANSWER
        if self.phase is not Phase.THINKING:
            return False
        self.num_thinking += 1
        if token == self.end_id:
            self.phase = Phase.ANSWER
        return True


def prompt_phase(parser: ReasoningParser, prompt_ids: list[int]) -> Phase:
    """Where the prompt leaves the reply: inside a think block it opened, after one it closed (thinking
    switched off), or before any (the model may open one)."""
    for t in reversed(prompt_ids):
        if t == parser.end_id:
            return Phase.ANSWER
        if t == parser.start_id:
            return Phase.THINKING
    return Phase.BEFORE


def attach_thinking(seqs: list[Sequence], parser: ReasoningParser | None, request: Request,
                    prompt_ids: list[int]) -> None:
    if parser is None or request.messages is None:
        return
    phase = prompt_phase(parser, prompt_ids)
    for seq in seqs:
        seq.think = ThinkState(parser.start_id, parser.end_id, seq.params.max_reasoning_tokens, phase)


def split_output(out: CompletionOutput, parser: ReasoningParser | None, request: Request, prompt_ids: list[int],
                 tokenizer: Any) -> None:
    """Move a chat reply's thinking from ``out.text`` to ``out.reasoning`` (in place). A reply cut inside
    its thinking keeps all of it as reasoning and an empty text (OpenAI's ``content: null``)."""
    if parser is None or request.messages is None:
        return
    ids = out.token_ids
    phase = prompt_phase(parser, prompt_ids)
    if phase is Phase.THINKING:
        first = 0
    elif phase is Phase.BEFORE and ids and ids[0] == parser.start_id:
        first = 1
    else:
        return  # it answered without thinking
    end = ids.index(parser.end_id) if parser.end_id in ids else None
    out.reasoning_tokens = len(ids) if end is None else end + 1
    text = out.text
    if first and text.lstrip().startswith(parser.start):
        text = text.lstrip()[len(parser.start):]
    cut = text.find(parser.end)
    if end is None:
        reasoning, answer = text, ""
    elif cut >= 0:
        reasoning, answer = text[:cut], text[cut + len(parser.end):]
    else:  # delimiters the detokenizer skipped as special tokens: decode each part (stop strings aside)
        reasoning = tokenizer.decode(ids[first:end], skip_special_tokens=True)
        answer = tokenizer.decode(ids[end + 1:], skip_special_tokens=True)
    # As the chat templates that re-render a reply do: no newlines around the thinking or before the answer.
    out.reasoning, out.text = reasoning.strip("\n"), answer.lstrip("\n")
