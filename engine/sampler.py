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

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from sluice.engine.counter_rng import exponential, row_key, uniform
from sluice.engine.outputs import TokenLogprob
from sluice.engine.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def sample(logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[set[int]], kernels: Any = None) -> SamplerOutput:
    """``logits`` [N, V] float32 on any device, one row per sequence; ``stop_ids`` are the ids that
    min_tokens holds back. ``kernels`` (kernels/cpu_fused on CPU) lends the passes over the vocabulary it
    has, each equal to the PyTorch it replaces: ``argmax`` (torch max's first maximum), ``topk_rows`` and
    ``exp_block_sums``. Penalties and held-back stops edit ``logits`` in place, or a copy where logprobs
    are asked for (they are of the raw logits)."""
    raw = logits
    held = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens and stop_ids[i]]
    penalised = [i for i, s in enumerate(seqs) if _has_penalty(s)]
    if held or penalised:  # edited through a flat view
        copy = any(s.params.logprobs is not None for s in seqs)
        logits = logits.clone(memory_format=torch.contiguous_format) if copy else logits.contiguous()
    if penalised:
        _apply_penalties(logits, seqs, penalised)
    if held:
        flat = _flat_ids(held, [sorted(stop_ids[i]) for i in held], logits.shape[1], logits.device)
        logits.view(-1)[flat] = float("-inf")
    if all(not s.params.greedy and _filters(s, logits.shape[1]) for s in seqs):
        # Every row races among its top-k candidates: no row needs the argmax pass.
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    else:
        # The first maximum, as argmax; torch's max is 4 ms against argmax's 7 at [160, 49152] on CPU.
        first_max = getattr(kernels, "argmax", None)
        tokens = first_max(logits) if first_max is not None else logits.max(dim=-1).indices
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        rows = _on(logits.device, sampled, torch.long)
        whole = len(sampled) == len(seqs)  # no copy of the logits when every row samples
        tokens[rows] = _sample_rows(logits if whole else logits[rows], [seqs[i] for i in sampled],
                                    tokens if whole else tokens[rows], kernels)
    return _to_host(raw, seqs, tokens)


# How many of a row's most likely tokens its filters are decided on when it sets no smaller top-k; a row
# whose top-p or min-p keeps more than these is redone over the whole vocabulary (exact, slower).
CANDIDATES = 64
# Tokens per block of the inverse-CDF draw: block sums first, then one block's cumulative sums.
BLOCK = 256


def _on(device: torch.device, values: list[Any], dtype: torch.dtype) -> torch.Tensor:
    """A small host list as a tensor on ``device``: on CUDA through pinned memory, queued without waiting
    (a copy from pageable memory holds the host until the stream reaches it). Made on the CPU whatever
    the caller's default device (``with torch.device("cuda")``), since only a host tensor pins."""
    t = torch.tensor(values, dtype=dtype, device="cpu")
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _row_values(seqs: list[Sequence], name: str, device: torch.device) -> torch.Tensor:
    """One sampling setting per row as a [N, 1] float32 column on ``device``."""
    return _on(device, [float(getattr(s.params, name)) for s in seqs], torch.float32)[:, None]


def _flat_ids(rows: list[int], ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """The flat indices ``row * vocab + id`` of ``ids[j]`` in row ``rows[j]`` (numpy builds them: the
    lists can hold a long prompt per row), on ``device`` in one copy."""
    parts = [np.asarray(row_ids, dtype=np.int64) + r * vocab for r, row_ids in zip(rows, ids, strict=True)]
    flat = torch.from_numpy(np.concatenate(parts))
    return flat if device.type == "cpu" else flat.pin_memory().to(device, non_blocking=True)


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> None:
    """In place, at the (row, token) pairs concerned only: no [N, V] mask or count tensors."""
    dev, vocab, flat = logits.device, logits.shape[1], logits.view(-1)
    # As in transformers: over prompt and output tokens, shrinking a logit towards zero either way. A
    # token seen twice is written twice with the same value.
    seen = _flat_ids(rows, [seqs[i].token_ids for i in rows], vocab, dev)
    rep = _row_values(seqs, "repetition_penalty", dev)[:, 0][seen // vocab]
    v = flat[seen]
    flat[seen] = torch.where(v > 0, v / rep, v * rep)
    # As in OpenAI: over output tokens only, once for presence and once per occurrence.
    out = _flat_ids(rows, [seqs[i].output_token_ids for i in rows], vocab, dev)
    if out.numel():
        row = out // vocab
        presence = _row_values(seqs, "presence_penalty", dev)[:, 0][row]
        frequency = _row_values(seqs, "frequency_penalty", dev)[:, 0][row]
        flat[out] = flat[out] - presence
        flat.index_put_((out,), -frequency, accumulate=True)


def _has_penalty(seq: Sequence) -> bool:
    p = seq.params
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence], argmax: torch.Tensor, kernels: Any) -> torch.Tensor:
    """Sampled rows' tokens: rows with a top-k, top-p or min-p filter race among their candidates; the
    others draw by inverse CDF over the whole vocabulary. ``argmax`` holds each row's first maximum."""
    dev, vocab = logits.device, logits.shape[1]
    keys = _on(dev, _row_keys(seqs), torch.int64)[:, None]
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
                               seqs if whole else [seqs[i] for i in rows], kernels)
    return tokens


def _row_keys(seqs: list[Sequence]) -> list[int]:
    """(seed + sample index, draws so far) for a seeded row, as the engine seeds each of a request's
    samples; fresh keys from torch's generator for the others."""
    fresh = iter(torch.randint(-(2**63), 2**63 - 1, (sum(s.params.seed is None for s in seqs),)).tolist())
    return [row_key(s.params.seed + s.index, s.num_output_tokens) if s.params.seed is not None else next(fresh)
            for s in seqs]


def _filters(seq: Sequence, vocab: int) -> bool:
    p = seq.params
    return 0 < p.top_k < vocab or p.top_p < 1 or p.min_p > 0


def _candidate_race(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, argmax: torch.Tensor,
                    seqs: list[Sequence], kernels: Any) -> torch.Tensor:
    """The exponential race argmax(log p - log E) over the tokens the filters keep, E ~ Exp(1) keyed by
    token id, so the winner does not depend on how the kept set was found. Filters are decided on the
    ``k`` most likely tokens alone (a top-k, not a sort of the vocabulary); a row whose kept set might
    reach past them (a top-p or min-p without a top-k that small) is redone over the whole vocabulary."""
    dev, vocab = logits.device, logits.shape[1]
    k = min(vocab, max(s.params.top_k if 0 < s.params.top_k < vocab else CANDIDATES for s in seqs))
    topk = getattr(kernels, "topk_rows", None)
    vals, ids = topk(logits, k) if topk is not None else logits.topk(k, dim=-1)  # descending
    rel = (vals - vals[:, :1]) / temps  # log(p / p_max), float32 as the logits
    top_k = _on(dev, [s.params.top_k or vocab for s in seqs], torch.long)[:, None]
    top_p, min_p = _row_values(seqs, "top_p", dev), _row_values(seqs, "min_p", dev)
    rank = torch.arange(k, device=dev)[None, :]
    drop = (rank >= top_k) | (rel < torch.log(min_p))
    if any(s.params.top_p < 1 for s in seqs):
        # p relative to the whole vocabulary: one pass of exp((x - max) / T) for the normaliser.
        z = _exp_block_sums(logits, vals[:, :1], 1.0 / temps, kernels).sum(dim=-1, keepdim=True)
        probs = rel.double().exp() / z
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
                 seqs: list[Sequence], kernels: Any) -> torch.Tensor:
    """One uniform u per row, and the first token whose cumulative mass (in token id order) passes u
    times the total: exp((x - max) / T) once, summed in blocks, then the cumulative sums in float64 over
    the blocks and within the chosen block only, so no [N, V] cumsum or float32 drift."""
    n, vocab = logits.shape
    top, inv_t = logits.gather(1, argmax[:, None]), 1.0 / temps
    cum = _exp_block_sums(logits, top, inv_t, kernels).cumsum(dim=-1)
    target = uniform(keys, torch.full_like(keys, -1)) * cum[:, -1:]
    b = torch.searchsorted(cum, target, right=True).clamp_(max=cum.shape[1] - 1)
    target -= torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)), 0.0)
    cols = b * BLOCK + torch.arange(BLOCK, device=logits.device)
    x = logits.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, float("-inf"))
    inner = (x - top).mul_(inv_t).exp_().double().cumsum(dim=-1)
    j = torch.searchsorted(inner, target, right=True).clamp_(max=BLOCK - 1)
    return (b[:, 0] * BLOCK + j[:, 0]).clamp_(max=vocab - 1)


def _exp_block_sums(logits: torch.Tensor, shift: torch.Tensor, inv_t: torch.Tensor, kernels: Any) -> torch.Tensor:
    """[N, ceil(V / BLOCK)] float64 sums of exp((x - shift) * inv_t) (``shift``, ``inv_t`` [N, 1]): in C++
    one read of each row; in PyTorch three passes over an [N, V] temporary."""
    op = getattr(kernels, "exp_block_sums", None)
    if op is not None:
        return op(logits, shift[:, 0].contiguous(), inv_t[:, 0].contiguous(), BLOCK)
    e = (logits - shift).mul_(inv_t).exp_()
    if e.shape[1] % BLOCK:
        e = torch.nn.functional.pad(e, (0, BLOCK - e.shape[1] % BLOCK))
    return e.view(e.shape[0], -1, BLOCK).sum(dim=-1, dtype=torch.float64)


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
