"""The workload shapes of bench/throughput.py (``--workload``): which prompts, as token ids, and which
sampling settings every system gets. Pure functions of the shared prompt sets and a tokenizer; no timing.

- ``chat``: one-turn chat prompts (the chat template applied), greedy: the original benchmark.
- ``sampled``: the same prompts sampled at T=0.8, top_p 0.95, top_k 50, a seed per request, ``n=4``
  samples per prompt sharing its prefill.
- ``long-prompt``: long distinct documents with a short answer (prefill-heavy): each prompt is a seeded
  random selection of the prompt sets' questions (both turns of MT-Bench's), numbered, 1,500-3,000
  tokens of real text in all, then "Summarise the questions above". The prompt sets are the corpus:
  real prompts written by others (../shared/data/prompts/SOURCES.md), no other download needed.
- ``few-shot``: one shared prefix of worked examples (MT-Bench's questions that carry reference answers,
  as "Question: ... / Answer: ...", about 1,000 tokens) and a short question each, raw completion (no
  chat template), stopping at the next "Question:". The prefix's token ids are the same in every prompt
  so that a prefix cache can share them.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts"
SETS = ("vicuna_bench.jsonl", "mt_bench.jsonl")
WORKLOADS = ("chat", "sampled", "long-prompt", "few-shot")
LONG_TOKENS = (1500, 3000)  # a long prompt's length, drawn uniformly, in tokens
FEW_SHOT_TOKENS = 1000  # the shared prefix grows by whole examples until it has this many tokens
SUMMARISE = "\n\nSummarise the questions above in a few sentences."
FEW_SHOT_INTRO = "Answer each question briefly and correctly.\n\n"
FEW_SHOT_STOP = "\nQuestion:"


@dataclass(frozen=True)
class Sampling:
    """What every system samples with (as SamplingParams reads it; vLLM's has the same names)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    n: int = 1
    seed: int | None = None  # per request: seed + its index (None: unseeded)
    stop: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Defaults:
    num_prompts: int
    max_tokens: int
    sampling: Sampling


DEFAULTS = {
    "chat": Defaults(160, 256, Sampling()),
    "sampled": Defaults(64, 256, Sampling(temperature=0.8, top_p=0.95, top_k=50, n=4, seed=0)),
    "long-prompt": Defaults(100, 64, Sampling()),
    "few-shot": Defaults(160, 128, Sampling(stop=[FEW_SHOT_STOP])),
}


def read_rows(prompts: Path = PROMPTS) -> list[dict[str, Any]]:
    rows = []
    for name in SETS:
        f = prompts / name
        if not f.exists():
            raise SystemExit(f"{f} not found: the benchmark reads the shared prompt sets beside the project")
        rows += [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return rows


def cycle(items: list[Any], n: int) -> list[Any]:
    return (items * (n // len(items) + 1))[:n]


def chat_ids(tok: Any, rows: list[dict[str, Any]], n: int) -> list[list[int]]:
    """The first turn of each row as a one-turn chat, the rows repeated to make ``n``."""
    return [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for r in cycle(rows, n)]


def long_prompt_ids(tok: Any, rows: list[dict[str, Any]], n: int, seed: int = 0) -> list[list[int]]:
    """``n`` distinct chat prompts of LONG_TOKENS tokens: questions in a seeded random order, numbered,
    added whole while they fit the drawn length, then the instruction."""
    rng = random.Random(seed)
    texts = [t for r in rows for t in r["turns"]]
    sizes = [len(tok.encode(t, add_special_tokens=False)) for t in texts]
    # The chat template and the instruction: measured once, so a prompt stays within the bounds.
    overhead = len(chat_ids(tok, [{"turns": [SUMMARISE]}], 1)[0]) + 8
    out = []
    for _ in range(n):
        target = rng.randint(*LONG_TOKENS) - overhead
        order = list(range(len(texts)))
        rng.shuffle(order)
        picked, used = [], 0
        for i in order:
            if used + sizes[i] + 4 <= target:  # "12. " and the blank line
                picked.append(texts[i])
                used += sizes[i] + 4
        while True:  # the estimate of the joins can be a few tokens short: drop questions until it fits
            doc = "\n\n".join(f"{k + 1}. {t}" for k, t in enumerate(picked)) + SUMMARISE
            ids = chat_ids(tok, [{"turns": [doc]}], 1)[0]
            if len(ids) <= LONG_TOKENS[1] or len(picked) == 1:
                break
            picked.pop()
        out.append(ids)
    return out


def few_shot_prefix(rows: list[dict[str, Any]], tok: Any) -> str:
    """Worked examples (questions with a reference answer) until the prefix reaches FEW_SHOT_TOKENS."""
    text = FEW_SHOT_INTRO
    for r in rows:
        if r.get("reference") and r["reference"][0].strip():
            text += f"Question: {r['turns'][0].strip()}\nAnswer: {r['reference'][0].strip()}\n\n"
            if len(tok.encode(text, add_special_tokens=False)) >= FEW_SHOT_TOKENS:
                break
    return text


def few_shot_ids(tok: Any, rows: list[dict[str, Any]], n: int) -> list[list[int]]:
    """The shared prefix's ids, then each question's: the prefix tokenised once, so every prompt
    starts with the very same ids."""
    prefix = tok.encode(few_shot_prefix(rows, tok), add_special_tokens=False)
    return [prefix + tok.encode(f"Question: {r['turns'][0].strip()}\nAnswer:", add_special_tokens=False)
            for r in cycle(rows, n)]


def build(name: str, tok: Any, num_prompts: int, rows: list[dict[str, Any]] | None = None) -> list[list[int]]:
    """The prompt token ids of workload ``name``."""
    rows = read_rows() if rows is None else rows
    if name in ("chat", "sampled"):
        return chat_ids(tok, rows, num_prompts)
    if name == "long-prompt":
        return long_prompt_ids(tok, rows, num_prompts)
    if name == "few-shot":
        return few_shot_ids(tok, rows, num_prompts)
    raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, not {name!r}")


def sampling_dict(s: Sampling) -> dict[str, Any]:
    return asdict(s)
