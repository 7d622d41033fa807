"""Turn each sequence's last-position logits into its next token.

Greedy rows take the argmax. Sampled rows go through penalties, temperature and the top-k / top-p /
min-p filters (vectorised over the batch), then an exponential race: argmax(p / E) with E ~ Exp(1)
picks token i with probability p_i. A seeded request draws E from its own generator, so its text does
not depend on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[set[int]]) -> SamplerOutput:
    """``logits`` [N, V] float32, one row per sequence; ``stop_ids`` are the ids min_tokens holds back."""
    raw = logits
    logits = _apply_penalties(logits, seqs)
    logits = _hold_back_stops(logits, seqs, stop_ids)
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        rows = torch.tensor(sampled)
        tokens[rows] = _sample_rows(logits[rows], [seqs[i] for i in sampled])
    token_list = tokens.tolist()
    return SamplerOutput(token_list, _logprobs(raw, seqs, token_list))


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if _has_penalty(s)]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:  # few rows set penalties; each is a handful of vector ops
        p, row = seqs[i].params, logits[i]
        if p.repetition_penalty != 1.0:  # as in transformers: over prompt and output
            seen = torch.tensor(sorted(set(seqs[i].token_ids)))
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        out = seqs[i].output_token_ids
        if out and (p.presence_penalty or p.frequency_penalty):  # as in OpenAI: over output only
            ids, counts = torch.tensor(out).unique(return_counts=True)
            row[ids] -= p.presence_penalty + p.frequency_penalty * counts.float()
    return logits


def _has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _hold_back_stops(logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[set[int]]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens and stop_ids[i]]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        logits[i, sorted(stop_ids[i])] = float("-inf")
    return logits


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    temps = torch.tensor([s.params.temperature for s in seqs])[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    probs = _filter(probs, seqs)
    noise = torch.empty_like(probs)
    for i, s in enumerate(seqs):
        noise[i].exponential_(generator=s.generator)
    return (probs / noise).argmax(dim=-1)


def _filter(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    top_k = torch.tensor([s.params.top_k or probs.shape[1] for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs])
    min_p = torch.tensor([s.params.min_p for s in seqs])
    if bool((top_k >= probs.shape[1]).all() and (top_p >= 1).all() and (min_p <= 0).all()):
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1])[None, :]
    # Keep a token if it is within top_k, the mass before it is under top_p, and p >= min_p * p_max;
    # the most likely token always survives.
    before = sorted_p.cumsum(dim=-1) - sorted_p
    drop = (rank >= top_k[:, None]) | (before >= top_p[:, None]) | (sorted_p < min_p[:, None] * sorted_p[:, :1])
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not want:
        return out
    lp = torch.log_softmax(logits[torch.tensor(want)], dim=-1)
    for row, i in enumerate(want):
        k = seqs[i].params.logprobs or 0
        top_v, top_i = lp[row].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        out[i] = TokenLogprob(tokens[i], float(lp[row, tokens[i]]), list(zip(top_i.tolist(), top_v.tolist(), strict=True)))
    return out
