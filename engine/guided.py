"""Structured output: a request's JSON schema, regex, choice or grammar, enforced token by token.

xgrammar does the work (chosen by measurement on CPU: on SmolLM2's 49k vocabulary a JSON schema
compiled in ~12 ms and a row's mask filled in ~10 us, against ~275 us for llguidance and ~5 ms for
outlines-core). Each distinct grammar is compiled once per engine and cached; each sequence gets its own
matcher. A step fills one bitmask for the rows that are constrained and applies it on the logits' device
before sampling; the free rows are left untouched. A grammar that does not compile fails its request
alone (``compile`` raises ValueError, which ``LLM.add_request`` turns into that request's error).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import torch
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence

CACHE_SIZE = 512  # compiled grammars kept per engine


def _xgr() -> Any:
    # Imported on first use: the import takes seconds and most engines never see a grammar.
    import xgrammar

    return xgrammar


class Guide:
    """One sequence's position in its grammar."""

    def __init__(self, compiled: Any) -> None:
        self.matcher = _xgr().GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def advance(self, token: int) -> str | None:
        """Take the sampled token; the finish reason if the grammar ends the sequence here."""
        if not self.matcher.accept_token(token):
            return "error"  # only a token outside the mask gets here (a min_tokens hold-back emptied it)
        return "stop" if self.matcher.is_terminated() else None


class GuidedDecoding:
    """An engine's grammar compiler and its cache of compiled grammars (errors are cached too)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_ids = sorted(stop_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, params: SamplingParams) -> Any:
        """The compiled grammar ``params`` ask for (None for free text); ValueError if it cannot compile."""
        key = guided_key(params)
        if key is None:
            return None
        with self._lock:
            hit = self._cache.get(key)
            if hit is None:
                hit = self._compile(key)
                self._cache[key] = hit
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
        if isinstance(hit, str):
            raise ValueError(hit)
        return hit

    def attach(self, seqs: list[Sequence], compiled: Any) -> None:
        if compiled is not None:
            for seq in seqs:
                seq.guide = Guide(compiled)

    def _compile(self, key: tuple[Any, ...]) -> Any:
        xgr = _xgr()
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        kind = key[0]
        try:
            grammar = _grammar(xgr, *key)
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            return f"the {_NAMES[kind]} does not compile: {_reason(e)}"
        self.num_compiled += 1
        return compiled


_NAMES = {"json": "guided_json schema", "json_object": "json_object format", "regex": "guided_regex",
          "choice": "guided_choice", "grammar": "guided_grammar"}


def guided_key(p: SamplingParams) -> tuple[Any, ...] | None:
    """What identifies a request's grammar (the cache key), or None for free text."""
    if p.guided_json is not None:
        spec: tuple[Any, ...] = ("json", p.guided_json)
    elif p.guided_json_object:
        spec = ("json_object", None)
    elif p.guided_regex is not None:
        spec = ("regex", p.guided_regex)
    elif p.guided_choice is not None:
        spec = ("choice", tuple(p.guided_choice))
    elif p.guided_grammar is not None:
        spec = ("grammar", p.guided_grammar)
    else:
        return None
    return (*spec, p.guided_prefix, p.guided_suffix)


def _grammar(xgr: Any, kind: str, value: Any, prefix: str, suffix: str) -> Any:
    if kind == "json":
        # Compact JSON: free whitespace lets a small model pad forever instead of closing the object.
        body = xgr.Grammar.from_json_schema(value, any_whitespace=False)
    elif kind == "json_object":
        body = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    elif kind == "regex":
        body = xgr.Grammar.from_regex(value)
    elif kind == "choice":
        body = xgr.Grammar.from_ebnf("root ::= " + " | ".join(_literal(c) for c in value))
    elif "::=" in value:
        body = xgr.Grammar.from_ebnf(value)
    else:
        body = xgr.Grammar.from_lark(value)
    parts = [xgr.Grammar.from_ebnf(f"root ::= {_literal(s)}") for s in (prefix,) if s]
    parts += [body] + [xgr.Grammar.from_ebnf(f"root ::= {_literal(s)}") for s in (suffix,) if s]
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else body


def _literal(s: str) -> str:
    """An EBNF string literal matching ``s`` exactly (JSON's escapes are EBNF's)."""
    return json.dumps(s) if s else '""'


def _reason(e: BaseException) -> str:
    """xgrammar's own words, on one line: what is wrong and where (its first line says both), and the
    grammar's line it points at when it shows one (Lark's errors quote it, then a caret under it)."""
    lines = [x for x in str(e).splitlines() if x.strip()]
    if not lines:
        return type(e).__name__
    what = _clean(lines[0].strip())
    if len(lines) >= 3 and lines[-1].strip() == "^":
        what += f" (in {lines[-2].strip()!r})"
    return what


def _clean(msg: str) -> str:
    # xgrammar prefixes "[time] /path/file.cc:line: " and its checks "Check failed: (...) is false: ";
    # the user needs what follows.
    if msg.startswith("[") and ": " in msg:
        msg = msg.split(": ", 1)[1]
    if msg.startswith("Check failed:") and " is false: " in msg:
        msg = msg.split(" is false: ", 1)[1]
    return msg


# ---- the step: one bitmask for the constrained rows --------------------------------------------
def apply_guided_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Mask, in place and on the logits' device, each constrained row to the tokens its grammar allows,
    and each row past its thinking budget to the end-of-thinking token (engine/reasoning.py).

    Called between ``compute_logits`` and sampling; on an accelerator the fill runs on the CPU while the
    device still computes the logits (nothing has synchronised yet)."""
    rows = [i for i, s in enumerate(seqs) if _masked(s)]
    if not rows:
        return
    xgr = _xgr()
    bitmask = _bitmask(xgr, logits.shape[0], logits.shape[-1])
    for i in rows:
        seq = seqs[i]
        think = seq.think
        if think is not None and think.must_end():
            bitmask[i].zero_()
            _allow(bitmask, i, think.end_id)
        else:
            seq.guide.fill(bitmask, i)
            if think is not None and think.may_start:
                _allow(bitmask, i, think.start_id)  # a reasoning model may open its thinking first
    if logits.device.type != "cpu":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def _masked(seq: Sequence) -> bool:
    """Whether ``seq``'s next token is constrained: by its grammar, except while it thinks (then only a
    spent thinking budget constrains it)."""
    think = seq.think
    if think is not None and think.thinking:
        return bool(think.must_end())
    return seq.guide is not None


def _allow(bitmask: torch.Tensor, row: int, token: int) -> None:
    # xgrammar's bitmask: 32 tokens per int32 word, token t at bit t % 32 of word t // 32.
    bit = 1 << (token % 32)
    bitmask[row, token // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit


_local = threading.local()  # per thread (engines in threads step concurrently): vocab -> bitmask buffer


def _bitmask(xgr: Any, rows: int, vocab: int) -> torch.Tensor:
    """A bitmask of ``rows`` rows, reused across steps (allocating one cost more than filling it): only
    the filled rows are ever applied, and a fill writes its whole row, so no reset is needed."""
    buffers: dict[int, torch.Tensor] = _local.__dict__.setdefault("buffers", {})
    buf = buffers.get(vocab)
    if buf is None or buf.shape[0] < rows:
        buf = buffers[vocab] = xgr.allocate_token_bitmask(max(rows, 64), vocab)
    return buf[:rows]


def advance_guide(seq: Sequence, token: int) -> str | None:
    """Move ``seq``'s grammar past ``token``; "stop" once it is complete, None while it goes on. A reasoning
    model's thinking tokens pass the grammar by: it starts after the end of thinking."""
    if seq.think is not None and seq.think.advance(token):
        return None
    return seq.guide.advance(token) if seq.guide is not None else None
