"""Prompt log-probabilities (OpenAI's echo + logprobs, vLLM's prompt_logprobs): each prompt token's
logprob under the tokens before it, its rank, and the top-k there. The first token has none.

Only the sequences that ask pay for it, and only as their prompt is computed: a step takes the hidden
rows of their prompt positions (at most ``max_num_batched_tokens`` rows, the step's token budget), makes
their logits ``CHUNK`` rows at a time and keeps, per position, the prompt token's logprob, its rank and
the k best: ``(k + 2)`` numbers a position. Besides the head's float32 logits, a chunk takes one float32
``CHUNK x vocab`` buffer, made once a step and reused: the log_softmax is written into it, then the
"likelier than the prompt token" mask that counts the rank (summed by a matrix-vector product: summing
a bool mask along rows is several times slower on CPU). The top-k is taken on the logits (the same
order), its values read from the log_softmax, so every value is transformers' own float32 log_softmax.

Chunked prefill needs nothing more: each chunk scores its own positions. A sequence that asks takes no
blocks from the prefix cache (``BlockManager.match_prefix``): its whole prompt is recomputed, so a cached
prefix still gets its logprobs, and its blocks still enter the cache for others. A prompt recomputed after
a preemption does not score the positions it already has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from sluice.engine.outputs import TokenLogprob
from sluice.engine.sequence import Sequence

CHUNK = 256  # rows of logits made at once


def wants_prompt_logprobs(seqs: list[Sequence]) -> bool:
    return any(_unscored(s) for s in seqs)


def _unscored(seq: Sequence) -> bool:
    lps = seq.prompt_logprobs
    return lps is not None and len(lps) < seq.num_prompt_tokens


@dataclass
class _Plan:
    """The step's rows to score: hidden row, the prompt token it scores, and per sequence how many."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    owners: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, its rows), in row order


def _plan(seqs: list[Sequence], num_new_tokens: list[int]) -> _Plan:
    plan, offset = _Plan(), 0
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        start = seq.num_computed_tokens  # before this step's tokens are counted in
        if _unscored(seq):
            assert seq.prompt_logprobs is not None
            # Position p's logits score prompt token p + 1; the entries so far cover tokens 0..len-1.
            lo, hi = max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)
            if hi > lo:
                plan.rows.extend(range(offset + lo - start, offset + hi - start))
                plan.targets.extend(seq.token_ids[lo + 1:hi + 1])
                plan.owners.append((seq, hi - lo))
        offset += n
    return plan


def record_prompt_logprobs(model: Any, hidden: torch.Tensor, seqs: list[Sequence], num_new_tokens: list[int]) -> None:
    """Score the prompt positions this step computed, for the sequences that ask (appended to each
    one's ``prompt_logprobs``). ``hidden`` holds the step's rows, sequence after sequence."""
    plan = _plan(seqs, num_new_tokens)
    if not plan.rows:
        return
    k_max = max(s.params.prompt_logprobs or 0 for s, _ in plan.owners)
    dev, n = hidden.device, len(plan.rows)
    rows = torch.tensor(plan.rows, device=dev)
    targets = torch.tensor(plan.targets, device=dev)
    chosen = torch.empty(n, device=dev)
    ranks = torch.empty(n, device=dev)
    top_lp = torch.empty(n, k_max, device=dev)
    top_id = torch.empty(n, k_max, dtype=torch.long, device=dev)
    buf: torch.Tensor | None = None
    ones: torch.Tensor | None = None
    for lo in range(0, n, CHUNK):
        hi = min(lo + CHUNK, n)
        logits = model.compute_logits(hidden[rows[lo:hi]])  # float32 [C, V]
        if buf is None or ones is None:
            buf = torch.empty(min(CHUNK, n), logits.shape[1], device=dev)
            ones = torch.ones(logits.shape[1], 1, device=dev)
        lp = torch.log_softmax(logits, dim=-1, out=buf[: hi - lo])
        tgt = targets[lo:hi, None]
        chosen_c = lp.gather(1, tgt)
        chosen[lo:hi] = chosen_c[:, 0]
        if k_max:
            ids = logits.max(dim=-1).indices[:, None] if k_max == 1 else logits.topk(k_max, dim=-1).indices
            top_id[lo:hi] = ids
            top_lp[lo:hi] = lp.gather(1, ids)
        del logits
        # The rank: 1 + how many tokens are likelier, counted as a float mask (exact below 2**24) times ones.
        likelier = torch.gt(lp, chosen_c, out=lp)
        ranks[lo:hi] = (likelier @ ones)[:, 0]
    _append(plan, chosen.tolist(), ranks.tolist(), top_id.tolist(), top_lp.tolist())


def _append(plan: _Plan, chosen: list[float], ranks: list[float], top_ids: list[list[int]],
            top_lps: list[list[float]]) -> None:
    i = 0
    for seq, count in plan.owners:
        k = seq.params.prompt_logprobs or 0
        entries = seq.prompt_logprobs
        assert entries is not None
        for j in range(i, i + count):
            top = list(zip(top_ids[j][:k], top_lps[j][:k], strict=True))
            entries.append(TokenLogprob(plan.targets[j], chosen[j], top, int(ranks[j]) + 1))
        i += count
