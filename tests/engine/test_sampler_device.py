"""The vectorised sampler against a copy of the per-row sampler it replaced (kept below, in this test,
as the reference, its noise drawn as the sampler keys it): same tokens and logprobs for greedy and seeded
rows, penalties, min_tokens hold-back and filters included, the filters over the whole sorted vocabulary
where the sampler decides them on a top-k. Random logits and settings from a printed seed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from helpers import TEST_DEVICE, fresh_seed
from sluice.engine.counter_rng import exponential, row_key, uniform
from sluice.engine.outputs import TokenLogprob
from sluice.engine.sampler import sample
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence

# ---- the replaced sampler, row by row (engine/sampler.py before sampling moved to the device) -------


@dataclass
class _RefOut:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _ref_sample(logits: torch.Tensor, seqs: list[Sequence], stop_ids: list[set[int]]) -> _RefOut:
    raw = logits
    logits = _ref_penalties(logits, seqs)
    rows = [i for i, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens and stop_ids[i]]
    if rows:
        logits = logits.clone()
        for i in rows:
            logits[i, sorted(stop_ids[i])] = float("-inf")
    tokens = logits.argmax(dim=-1)
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    if sampled:
        idx = torch.tensor(sampled)
        tokens[idx] = _ref_sample_rows(logits[idx], [seqs[i] for i in sampled])
    token_list = tokens.tolist()
    return _RefOut(token_list, _ref_logprobs(raw, seqs, token_list))


def _ref_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if s.params.repetition_penalty != 1.0 or s.params.presence_penalty != 0.0
            or s.params.frequency_penalty != 0.0]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, row = seqs[i].params, logits[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seqs[i].token_ids)))
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        out = seqs[i].output_token_ids
        if out and (p.presence_penalty or p.frequency_penalty):
            ids, counts = torch.tensor(out).unique(return_counts=True)
            row[ids] -= p.presence_penalty + p.frequency_penalty * counts.float()
    return logits


def _ref_sample_rows(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    temps = torch.tensor([s.params.temperature for s in seqs])[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    top_k = torch.tensor([s.params.top_k or probs.shape[1] for s in seqs])
    top_p = torch.tensor([s.params.top_p for s in seqs])
    min_p = torch.tensor([s.params.min_p for s in seqs])
    if not bool((top_k >= probs.shape[1]).all() and (top_p >= 1).all() and (min_p <= 0).all()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1])[None, :]
        before = sorted_p.cumsum(dim=-1) - sorted_p
        drop = (rank >= top_k[:, None]) | (before >= top_p[:, None]) | (sorted_p < min_p[:, None] * sorted_p[:, :1])
        drop[:, 0] = False
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))
    # The noise as the sampler keys it (engine/counter_rng.py), drawn here over the whole vocabulary: the
    # race over the kept tokens for a filtered row, one float64 cumsum's inverse CDF for the others.
    keys = torch.tensor([row_key((s.params.seed or 0) + s.index, s.num_output_tokens) for s in seqs])[:, None]
    out = []
    for i, s in enumerate(seqs):
        p = s.params
        if 0 < p.top_k < probs.shape[1] or p.top_p < 1 or p.min_p > 0:
            noise = exponential(keys[i:i + 1], torch.arange(probs.shape[1])[None, :])[0]
            out.append(int((probs[i].double().log() - noise.log()).argmax()))
        else:
            cum = probs[i].double().cumsum(0)
            u = uniform(keys[i:i + 1], torch.full((1, 1), -1))[0]
            out.append(int(torch.searchsorted(cum, u * cum[-1], right=True)))
    return torch.tensor(out)


def _ref_logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * len(seqs)
    want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    if not want:
        return out
    lp = torch.log_softmax(logits[torch.tensor(want)], dim=-1)
    for row, i in enumerate(want):
        k = seqs[i].params.logprobs or 0
        top_v, top_i = lp[row].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        out[i] = TokenLogprob(tokens[i], float(lp[row, tokens[i]]), list(zip(top_i.tolist(), top_v.tolist(), strict=True)))
    return out


# ---- the comparison -----------------------------------------------------------------------------------

VOCAB = 512


@pytest.fixture(autouse=True)
def on_test_device() -> Iterator[None]:
    """Logits and every tensor the tests make on the test device (SLUICE_TEST_DEVICE: cuda on a GPU)."""
    with torch.device(TEST_DEVICE):
        yield


def _random_params(rng: random.Random) -> SamplingParams:
    greedy = rng.random() < 0.3
    return SamplingParams(
        max_tokens=64,
        min_tokens=rng.choice([0, 0, 20]),
        temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 5, 50]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        min_p=rng.choice([0.0, 0.0, 0.05]),
        seed=rng.randrange(10**6),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.8]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -0.4]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3]),
        logprobs=rng.choice([None, None, 0, 3]),
    )


def _batch(rng: random.Random, n: int) -> tuple[list[Sequence], list[Sequence], list[set[int]]]:
    """Two copies of the same ``n`` sequences (same seeds)."""
    ours, ref, stops = [], [], []
    for i in range(n):
        p = _random_params(rng)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 30))]
        for copy in (ours, ref):
            copy.append(Sequence(i, f"r{i}", 0, prompt + output, len(prompt), p))
        stops.append({rng.randrange(VOCAB) for _ in range(rng.randint(0, 3))})
    return ours, ref, stops


@pytest.mark.parametrize("n", [1, 7, 40])
def test_device_sampler_matches_the_per_row_sampler(n: int) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    ours, ref, stops = _batch(rng, n)
    for _ in range(5):  # several steps: each seeded row draws anew, identically on both sides
        logits = 3 * torch.randn(n, VOCAB)
        logits[:, rng.randrange(VOCAB)] += 4  # a clear favourite, sometimes a stop id held back
        got = sample(logits.clone(), ours, stops)
        want = _ref_sample(logits.clone(), ref, stops)
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-6)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-6)
        for a_seq, b_seq, tok in zip(ours, ref, got.token_ids, strict=True):
            a_seq.token_ids.append(tok)
            b_seq.token_ids.append(tok)


def test_held_back_stops_and_penalties_act_on_device_rows() -> None:
    """min_tokens hides the stop ids; a huge frequency penalty hides every id already generated."""
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 10.0
    logits[:, 9] = 5.0
    held = Sequence(0, "a", 0, [1, 2], 2, SamplingParams(min_tokens=3))
    penal = Sequence(1, "b", 0, [1, 2, 7, 7], 2, SamplingParams(frequency_penalty=100.0))
    out = sample(logits, [held, penal], [{7}, set()])
    assert out.token_ids == [9, 9]
