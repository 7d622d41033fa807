"""Turn each sequence's last-position logits into its next token, on the logits' own device.

Greedy rows take the argmax. Sampled rows go through penalties, temperature and the top-k / top-p /
min-p filters, then an exponential race: argmax(p / E) with E ~ Exp(1) picks token i with
probability p_i. A seeded request's E does not depend on what else shares the batch: on CUDA every
seeded row's noise comes from one Philox launch keyed by (seed, draw number) (kernels/sampling.py);
elsewhere from the request's own generator. Every step is vectorised over the batch; the per-request
settings travel to the device as one small tensor each (from pinned memory on CUDA, so the host does not
wait), and only the chosen ids (and requested logprobs) come back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

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
        tokens[rows] = _sample_rows(logits[rows], [seqs[i] for i in sampled])
    return _to_host(raw, seqs, tokens)


# Devices whose seeded rows draw their noise in one kernel launch (tests add "cpu" to run it interpreted).
SEEDED_KERNEL_DEVICES = {"cuda"}


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


def _sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    temps = _row_values(seqs, "temperature", logits.device)
    probs = _filter(torch.softmax(logits / temps, dim=-1), seqs)
    return (probs / _exponential_noise(probs, seqs)).argmax(dim=-1)


def _exponential_noise(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Exp(1) noise shaped like ``probs``: one draw for every unseeded row, then the seeded rows: on CUDA
    all in one launch keyed by (seed + sample index, tokens drawn so far), as the engine seeds each
    sample; elsewhere each from its own generator (made by the engine on the logits' device)."""
    noise = torch.empty_like(probs)
    kernel = probs.device.type in SEEDED_KERNEL_DEVICES
    seeded = [i for i, s in enumerate(seqs) if (s.params.seed is not None if kernel else s.generator is not None)]
    if len(seeded) < len(seqs):
        noise.exponential_()  # seeded rows are overwritten below
    if seeded and kernel:
        from kernels.sampling import philox_keys, seeded_exponential

        keys = philox_keys([(seqs[i].params.seed or 0) + seqs[i].index for i in seeded],
                           [seqs[i].num_output_tokens for i in seeded])
        return seeded_exponential(noise, _on(probs.device, seeded, torch.long), _on(probs.device, keys, torch.int64))
    for i in seeded:
        noise[i].exponential_(generator=seqs[i].generator)
    return noise


def _filter(probs: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    vocab = probs.shape[1]
    if all((s.params.top_k or vocab) >= vocab and s.params.top_p >= 1 and s.params.min_p <= 0 for s in seqs):
        return probs  # decided on the host: no device sync
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
