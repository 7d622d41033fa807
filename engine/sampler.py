"""Turn each sequence's last-position logits into its next token, on the logits' own device.

Greedy rows take the argmax. Sampled rows go through penalties and temperature, then:
- with a top-k, top-p or min-p filter, an exponential race among the most likely few tokens (a top-k of
  the logits, not a sort of the vocabulary): argmax(p / E) with E ~ Exp(1) picks kept token i with
  probability p_i (renormalised); a row whose kept set might reach past those few is redone exactly;
- without one, an inverse-CDF draw over the whole vocabulary with one uniform.
Every random number is a counter-based hash of the row's key (seed, sample index, draws so far) and a
counter (engine/counter_rng.py), so a seeded request's tokens depend on nothing else in the batch, and
the same seed gives the same tokens on every device. Every step is vectorised over the batch; the
per-request settings travel to the device as one small tensor each (from pinned memory on CUDA, so the
host does not wait), and only the chosen ids (and requested logprobs) come back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.counter_rng import exponential, row_key, uniform
from engine.outputs import TokenLogprob
from engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[set[int]],
           first_max: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
    """``logits`` [N, V] float32 on any device, one row per sequence; ``stop_ids`` are the ids that
    min_tokens holds back; ``first_max`` computes greedy rows' tokens (kernels/cpu_fused.argmax) in place
    of torch's ``max(dim=-1).indices``, which it must equal."""
    raw = logits
    logits = _apply_penalties(logits, seqs)
    logits = _hold_back_stops(logits, seqs, stop_ids)
    # The first maximum, as argmax; torch's max is 4 ms against argmax's 7 at [160, 49152] on CPU.
    tokens = first_max(logits) if first_max is not None else logits.max(dim=-1).indices
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        rows = _on(logits.device, sampled, torch.long)
        whole = len(sampled) == len(seqs)  # no copy of the logits when every row samples
        tokens[rows] = _sample_rows(logits if whole else logits[rows], [seqs[i] for i in sampled],
                                    tokens if whole else tokens[rows])
    return _to_host(raw, seqs, tokens)


# How many of a row's most likely tokens its filters are decided on when it sets no smaller top-k; a row
# whose top-p or min-p keeps more than these is redone over the whole vocabulary (exact, slower).
CANDIDATES = 64
# Tokens per block of the inverse-CDF draw: block sums first, then one block's cumulative sums.
BLOCK = 256


def _on(device: torch.device, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
    """A small host list as a tensor on ``device``: on CUDA through pinned memory, queued without waiting
    (a copy from pageable memory holds the host until the stream reaches it)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _row_values(seqs: list[Sequence], name: str, device: torch.device) -> torch.Tensor:
    """One sampling setting per row as a [N, 1] float32 column on ``device``."""
    return _on(device, [float(getattr(s.params, name)) for s in seqs], torch.float32)[:, None]


def _scatter_ids(shape: torch.Size, rows: list[int], ids: list[list[int]], device: torch.device) -> torch.Tensor:
    """[N, V] float32 counts of ``ids[j]`` in row ``rows[j]``: one host-to-device copy for all rows."""
    flat_rows = [r for r, row_ids in zip(rows, ids, strict=True) for _ in row_ids]
    flat_ids = [t for row_ids in ids for t in row_ids]
    index = _on(device, [flat_rows, flat_ids], torch.long)
    counts = torch.zeros(shape, dtype=torch.float32, device=device)
    counts.index_put_((index[0], index[1]), torch.ones(len(flat_ids), device=device), accumulate=True)
    return counts


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if _has_penalty(s)]
    if not rows:
        return logits
    dev = logits.device
    rep = _row_values(seqs, "repetition_penalty", dev)
    # As in transformers: over prompt and output tokens, shrinking a logit towards zero either way.
    seen = _scatter_ids(logits.shape, rows, [seqs[i].token_ids for i in rows], dev) > 0
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    # As in OpenAI: over output tokens only, once for presence and once per occurrence.
    counts = _scatter_ids(logits.shape, rows, [seqs[i].output_token_ids for i in rows], dev)
    presence, frequency = _row_values(seqs, "presence_penalty", dev), _row_values(seqs, "frequency_penalty", dev)
    return torch.where(counts > 0, logits - (presence + frequency * counts), logits)


def _has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _hold_back_stops(logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[set[int]]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens and stop_ids[i]]
    if not rows:
        return logits
    held = _scatter_ids(logits.shape, rows, [sorted(stop_ids[i]) for i in rows], logits.device) > 0
    return logits.masked_fill(held, float("-inf"))


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence], argmax: torch.Tensor) -> torch.Tensor:
    """Sampled rows' tokens: rows with a top-k, top-p or min-p filter race among their candidates; the
    others draw by inverse CDF over the whole vocabulary. ``argmax`` holds each row's first maximum."""
    dev, vocab = logits.device, logits.shape[1]
    keys = _on(dev, [_row_key(s) for s in seqs], torch.int64)[:, None]
    temps = _row_values(seqs, "temperature", dev)
    filtered = [i for i, s in enumerate(seqs) if _filters(s, vocab)]
    plain = [i for i, s in enumerate(seqs) if not _filters(s, vocab)]
    tokens = torch.empty(len(seqs), dtype=torch.long, device=dev)
    for rows, draw in ((filtered, _candidate_race), (plain, _inverse_cdf)):
        if rows:
            idx = _on(dev, rows, torch.long)
            whole = len(rows) == len(seqs)  # take the tensors as they are: no copy of the logits
            tokens[idx] = draw(logits if whole else logits[idx], temps if whole else temps[idx],
                               keys if whole else keys[idx], argmax if whole else argmax[idx],
                               seqs if whole else [seqs[i] for i in rows])
    return tokens


def _row_key(seq: Sequence) -> int:
    """(seed + sample index, draws so far) for a seeded row, as the engine seeds each of a request's
    samples; a fresh key from torch's generator for the others."""
    if seq.params.seed is None:
        return int(torch.randint(-(2**63), 2**63 - 1, ()))
    return row_key(seq.params.seed + seq.index, seq.num_output_tokens)


def _filters(seq: Sequence, vocab: int) -> bool:
    p = seq.params
    return 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0


def _candidate_race(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, argmax: torch.Tensor,
                    seqs: list[Sequence]) -> torch.Tensor:
    """The exponential race argmax(log p - log E) over the tokens the filters keep, E ~ Exp(1) keyed by
    token id, so the winner does not depend on how the kept set was found. Filters are decided on the
    ``k`` most likely tokens alone (a top-k, not a sort of the vocabulary); a row whose kept set might
    reach past them (a top-p or min-p without a top-k that small) is redone over the whole vocabulary."""
    dev, vocab = logits.device, logits.shape[1]
    k = min(vocab, max(s.params.top_k if 0 < s.params.top_k < vocab else CANDIDATES for s in seqs))
    vals, ids = logits.topk(k, dim=-1)  # descending
    rel = (vals - vals[:, :1]) / temps  # log(p / p_max), float32 as the logits
    top_k = _on(dev, [s.params.top_k or vocab for s in seqs], torch.long)[:, None]
    top_p, min_p = _row_values(seqs, "top_p", dev), _row_values(seqs, "min_p", dev)
    rank = torch.arange(k, device=dev)[None, :]
    drop = (rank >= top_k) | (rel < torch.log(min_p))
    if any(s.params.top_p < 1 for s in seqs):
        # p relative to the whole vocabulary: one pass of exp((x - max) / T) for the normaliser.
        inv_t = 1.0 / temps
        z = torch.addcmul(-vals[:, :1] * inv_t, logits, inv_t).exp_().sum(dim=-1, keepdim=True)
        probs = rel.exp() / z
        before = probs.cumsum(dim=-1) - probs
        drop |= (before >= top_p) & (top_p < 1)
        reached = (before[:, -1:] + probs[:, -1:] >= top_p) & (top_p < 1)
    else:
        reached = torch.zeros_like(top_p, dtype=torch.bool)
    drop[:, 0] = False  # the most likely token always survives
    # Exact on the candidates when the row's kept set ends within them: its top-k fits, or the top-p
    # mass or the min-p bound is reached by the last candidate.
    exact = (top_k <= k) | reached | (rel[:, -1:] < torch.log(min_p)) | (k == vocab)
    score = rel.double().masked_fill_(drop, float("-inf")) - exponential(keys, ids).log_()
    tokens = ids.gather(1, score.argmax(dim=-1, keepdim=True))[:, 0]
    redo = exact[:, 0].logical_not().nonzero()[:, 0].tolist()  # a sync, as .tolist() of the tokens is anyway
    if redo:
        tokens[redo] = _full_race(logits[redo], temps[redo], keys[redo], [seqs[i] for i in redo])
    return tokens


def _full_race(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The same race over the whole vocabulary, the filters applied to the sorted distribution."""
    probs = _filter(torch.softmax(logits / temps, dim=-1), seqs)
    ids = torch.arange(logits.shape[1], device=logits.device).expand_as(logits)
    return (probs.double().log_() - exponential(keys, ids).log_()).argmax(dim=-1)


def _inverse_cdf(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, argmax: torch.Tensor,
                 seqs: list[Sequence]) -> torch.Tensor:
    """One uniform u per row, and the first token whose cumulative mass (in token id order) passes u
    times the total: exp((x - max) / T) once, summed in blocks, then the cumulative sums in float64 over
    the blocks and within the chosen block only, so no [N, V] cumsum or float32 drift."""
    n, vocab = logits.shape
    top = logits.gather(1, argmax[:, None])
    inv_t = 1.0 / temps
    e = torch.addcmul(-top * inv_t, logits, inv_t).exp_()
    if vocab % BLOCK:
        e = torch.nn.functional.pad(e, (0, BLOCK - vocab % BLOCK))
    blocks = e.view(n, -1, BLOCK)
    cum = blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1)
    target = uniform(keys, torch.full_like(keys, -1)) * cum[:, -1:]
    b = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)
    target -= torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = blocks[torch.arange(n, device=logits.device), b[:, 0]].double().cumsum(dim=-1)
    j = torch.searchsorted(inner, target, right=True).clamp_(max=BLOCK - 1)
    return (b[:, 0] * BLOCK + j[:, 0]).clamp_(max=vocab - 1)


def _filter(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """The exact filters over the sorted vocabulary (probs [N, V]): kept tokens keep their p, others 0."""
    vocab = probs.shape[1]
    dev = probs.device
    top_k = _on(dev, [s.params.top_k or vocab for s in seqs], torch.long)[:, None]
    top_p, min_p = _row_values(seqs, "top_p", dev), _row_values(seqs, "min_p", dev)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    # Keep a token if it is within top_k, the mass before it is under top_p, and p >= min_p * p_max;
    # the most likely token always survives.
    before = sorted_p.cumsum(dim=-1) - sorted_p
    drop = (rank >= top_k) | (before >= top_p) | (sorted_p < min_p * sorted_p[:, :1])
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def _to_host(raw: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor) -> SamplerOutput:
    """Bring back the chosen ids and, for rows that asked, their logprob and the top-k: one copy each."""
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not want:
        return SamplerOutput(tokens.tolist(), [None] * len(seqs))
    rows = _on(raw.device, want, torch.long)
    lp = torch.log_softmax(raw[rows], dim=-1)
    chosen = lp.gather(1, tokens[rows][:, None])[:, 0]
    k_max = max(seqs[i].params.logprobs or 0 for i in want)
    top_v, top_i = lp.topk(k_max, dim=-1)
    token_list = tokens.tolist()
    chosen_l, top_v_l, top_i_l = chosen.tolist(), top_v.tolist(), top_i.tolist()
    out: list[TokenLogprob | None] = [None] * len(seqs)
    for row, i in enumerate(want):
        k = seqs[i].params.logprobs or 0
        out[i] = TokenLogprob(token_list[i], chosen_l[row], list(zip(top_i_l[row][:k], top_v_l[row][:k], strict=True)))
    return SamplerOutput(token_list, out)
