"""Prompt log-probabilities (OpenAI's echo + logprobs, vLLM's prompt_logprobs): each prompt token's
logprob under the tokens before it, and the top-k there. The first token has none.

Only the sequences that ask pay for it, and only as their prompt is computed: a step takes the hidden
rows of their prompt positions (at most ``max_num_batched_tokens`` rows, the step's token budget), makes
their logits ``CHUNK`` rows at a time (``CHUNK x vocab`` float32 at most, freed at once) and keeps, per
position, the prompt token's logprob and the k best: ``(k + 1)`` numbers a position.

Chunked prefill needs nothing more: each chunk scores its own positions. A sequence that asks takes no
blocks from the prefix cache (``BlockManager.match_prefix``): its whole prompt is recomputed, so a cached
prefix still gets its logprobs, and its blocks still enter the cache for others. A prompt recomputed after
a preemption does not score the positions it already has.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.outputs import TokenLogprob
from engine.sequence import Sequence

CHUNK = 256  # rows of logits made at once


def wants_prompt_logprobs(seqs: list[Sequence]) -> bool:
    return any(_unscored(s) for s in seqs)


def _unscored(seq: Sequence) -> bool:
    lps = seq.prompt_logprobs
    return lps is not None and len(lps) < seq.num_prompt_tokens


def record_prompt_logprobs(model: Any, hidden: torch.Tensor, seqs: list[Sequence], num_new_tokens: list[int]) -> None:
    """Score the prompt positions this step computed, for the sequences that ask (appended to each
    one's ``prompt_logprobs``). ``hidden`` holds the step's rows, sequence after sequence."""
    rows, targets, owners, ks = [], [], [], []
    offset = 0
    for seq, n in zip(seqs, num_new_tokens, strict=True):
        start = seq.num_computed_tokens  # before this step's tokens are counted in
        if _unscored(seq):
            assert seq.prompt_logprobs is not None
            # Position p's logits score prompt token p + 1; the entries so far cover tokens 0..len-1.
            for p in range(max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1)):
                rows.append(offset + p - start)
                targets.append(seq.token_ids[p + 1])
                owners.append(seq)
                ks.append(seq.params.prompt_logprobs or 0)
        offset += n
    if not rows:
        return
    k_max = max(ks)
    for lo in range(0, len(rows), CHUNK):
        idx = torch.tensor(rows[lo:lo + CHUNK], device=hidden.device)
        logprobs = torch.log_softmax(model.compute_logits(hidden[idx]).float(), dim=-1)
        tgt = torch.tensor(targets[lo:lo + CHUNK], device=hidden.device)
        chosen_t = logprobs.gather(1, tgt[:, None])
        ranks = ((logprobs > chosen_t).sum(dim=1) + 1).tolist()
        chosen = chosen_t[:, 0].tolist()
        top_lp, top_id = (logprobs.topk(k_max, dim=-1) if k_max else (logprobs[:, :0], logprobs[:, :0].long()))
        top_lps, top_ids = top_lp.tolist(), top_id.tolist()
        for j, lp in enumerate(chosen):
            i, k = lo + j, ks[lo + j]
            entry = TokenLogprob(targets[i], lp, list(zip(top_ids[j][:k], top_lps[j][:k], strict=True)), ranks[j])
            owners[i].prompt_logprobs.append(entry)  # type: ignore[union-attr]
