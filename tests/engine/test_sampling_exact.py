"""The sampler's counter-based draws (engine/counter_rng.py, engine/sampler.py): the hash is SplitMix64
on every device, each sampling path draws from the exact filtered softmax (chi-square against it), the
top-k candidates decide what the whole sorted vocabulary would, and a seeded row's tokens do not depend
on what shares its batch; each with the C++ passes over the vocabulary (kernels/cpu/sampling.cpp, on
CPU) and with PyTorch's, which the ops are also checked against directly. Random inputs from a printed
seed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import TEST_DEVICE, fresh_seed
from scipy.stats import chisquare
from sluice.engine import sampler
from sluice.engine.counter_rng import mix64, mix64_tensor, row_key, uniform
from sluice.engine.sampler import sample
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence


@pytest.fixture(autouse=True)
def on_test_device() -> Iterator[None]:
    with torch.device(TEST_DEVICE):
        yield


@pytest.fixture(params=["torch", "cpp"])
def kernels(request: pytest.FixtureRequest) -> Any:
    """None: PyTorch's passes; or the C++ ops the model runner hands the sampler on CPU."""
    if request.param == "torch":
        return None
    if TEST_DEVICE != "cpu":
        pytest.skip("the C++ ops are CPU ops")
    from sluice.kernels import cpu_fused

    return cpu_fused


def _seq(i: int, params: SamplingParams, drawn: int = 0) -> Sequence:
    return Sequence(i, f"r{i}", 0, [1, 2, 3] + [4] * drawn, 3, params)


def test_the_tensor_hash_is_splitmix64() -> None:
    rng = random.Random(fresh_seed())
    xs = [rng.randrange(2**64) for _ in range(2000)] + [0, 2**63, 2**64 - 1, 1]
    signed = torch.tensor([x - 2**64 if x >= 2**63 else x for x in xs], dtype=torch.int64)
    got = [v & (2**64 - 1) for v in mix64_tensor(signed).tolist()]
    assert got == [mix64(x) for x in xs]


def test_uniforms_are_uniform_and_keyed() -> None:
    rng = random.Random(fresh_seed())
    keys = torch.tensor([row_key(rng.randrange(2**32), d) for d in range(8)])[:, None]
    u = uniform(keys, torch.arange(-1, 20000)[None, :].expand(8, -1))
    assert u.dtype == torch.float64 and bool((u > 0).all() and (u < 1).all())
    # 160,008 uniforms: mean 1/2 and variance 1/12 (standard errors 0.0007 and 0.0002), deciles even.
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    counts = torch.histc(u.float(), bins=10, min=0, max=1).tolist()
    assert chisquare(counts).pvalue > 1e-4
    assert len({tuple(row) for row in u[:, :16].tolist()}) == 8  # each draw number its own stream
    assert torch.equal(uniform(keys[3:4], torch.arange(-1, 50)[None, :]), u[3:4, :51])  # a pure function


# Eight live tokens in a vocabulary of 700 (the rest at -inf), around the inverse-CDF's 256-token blocks.
LIVE = [3, 255, 256, 300, 511, 512, 650, 699]
VOCAB = 700


def _expected(logits: torch.Tensor, p: SamplingParams) -> list[float]:
    """The filtered softmax over LIVE, computed directly from the definitions."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)[LIVE].tolist()
    order = sorted(range(len(LIVE)), key=lambda i: -probs[i])
    kept, before = [], 0.0
    for rank, i in enumerate(order):
        if rank == 0 or ((p.top_k == 0 or rank < p.top_k) and before < p.top_p and probs[i] >= p.min_p * probs[order[0]]):
            kept.append(i)
        before += probs[i]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(LIVE))]


@pytest.mark.parametrize("settings,candidates", [
    (dict(temperature=0.8), 64),  # no filter: the inverse CDF
    (dict(temperature=1.3, top_k=5), 64),  # the race among the top-k
    (dict(temperature=0.8, top_p=0.8), 64),  # top-p decided on the candidates
    (dict(temperature=1.0, min_p=0.15), 64),
    (dict(temperature=0.8, top_p=0.9, top_k=6, min_p=0.02), 64),
    (dict(temperature=0.8, top_p=0.9), 2),  # too few candidates: the whole vocabulary, redone
])
def test_every_path_samples_the_filtered_softmax(settings: dict, candidates: int, kernels: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler, "CANDIDATES", candidates)
    rng = random.Random(fresh_seed())
    logits = torch.full((VOCAB,), float("-inf"))
    logits[LIVE] = torch.tensor([rng.uniform(-2, 2) for _ in LIVE])
    first = rng.randrange(2**40)
    n = 6000
    seqs = [_seq(i, SamplingParams(seed=first + i, **settings)) for i in range(n)]
    tokens = sample(logits.expand(n, -1).clone(), seqs, [set()] * n, kernels).token_ids
    want = _expected(logits, seqs[0].params)
    counts = [tokens.count(t) for t in LIVE]
    assert sum(counts) == n, "only live tokens are drawn"
    kept = [i for i, w in enumerate(want) if w > 0]
    assert all(counts[i] == 0 for i in range(len(LIVE)) if want[i] == 0), (counts, want)
    if len(kept) > 1:
        test = chisquare([counts[i] for i in kept], [n * want[i] for i in kept])
        assert test.pvalue > 1e-4, (counts, want, test)


def _random_params(rng: random.Random) -> SamplingParams:
    return SamplingParams(temperature=rng.choice([0.0, 0.7, 1.0, 1.5]), top_k=rng.choice([0, 0, 3, 40]),
                          top_p=rng.choice([1.0, 0.5, 0.95]), min_p=rng.choice([0.0, 0.0, 0.1]),
                          seed=rng.choice([None, rng.randrange(10**6)]))


def test_candidates_decide_what_the_whole_vocabulary_would(kernels: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same tokens whether the filters run on the default top-k of candidates, on a single candidate
    (every top-p / min-p row redone) or on the whole vocabulary: the noise is keyed by token id."""
    rng = random.Random(fresh_seed())
    n, vocab = 60, 3000
    params = [_random_params(rng) for _ in range(n)]
    params = [p if p.seed is not None else SamplingParams(**{**p.__dict__, "seed": 1}) for p in params]
    logits = 2.5 * torch.randn(n, vocab, generator=torch.Generator(TEST_DEVICE).manual_seed(rng.randrange(2**31)))
    results = []
    for candidates in (sampler.CANDIDATES, 1, vocab):
        monkeypatch.setattr(sampler, "CANDIDATES", candidates)
        results.append(sample(logits.clone(), [_seq(i, p, 3) for i, p in enumerate(params)], [set()] * n,
                              kernels).token_ids)
    assert results[0] == results[1] == results[2]
    monkeypatch.setattr(sampler, "CANDIDATES", 64)
    other = None if kernels is not None else _cpu_ops()
    if other is not None:  # and the same whichever passes ran
        assert sample(logits.clone(), [_seq(i, p, 3) for i, p in enumerate(params)], [set()] * n,
                      other).token_ids == results[0]


def test_a_seeded_row_draws_the_same_alone_and_in_any_batch(kernels: Any) -> None:
    rng = random.Random(fresh_seed())
    vocab = 1000
    gen = torch.Generator(TEST_DEVICE).manual_seed(rng.randrange(2**31))
    for mine in (SamplingParams(temperature=0.9, seed=rng.randrange(10**6)),
                 SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=rng.randrange(10**6))):
        row = torch.randn(vocab, generator=gen)
        alone = [sample(row[None].clone(), [_seq(0, mine, d)], [set()], kernels).token_ids[0] for d in range(6)]
        assert len(set(alone)) > 1, "each draw is keyed anew"
        for _ in range(3):
            others = [_random_params(rng) for _ in range(rng.randint(1, 12))]
            at = rng.randint(0, len(others))
            batch = [*others[:at], mine, *others[at:]]
            got = []
            for d in range(6):
                logits = torch.randn(len(batch), vocab, generator=gen)
                logits[at] = row
                seqs = [_seq(i, p, d) for i, p in enumerate(batch)]
                got.append(sample(logits, seqs, [set()] * len(batch), kernels).token_ids[at])
            assert got == alone


def test_unseeded_rows_follow_torchs_generator() -> None:
    logits = torch.zeros(4, 5000)
    seqs = [_seq(i, SamplingParams(temperature=1.0)) for i in range(4)]
    torch.manual_seed(fresh_seed())
    state = torch.get_rng_state()
    first = sample(logits.clone(), seqs, [set()] * 4).token_ids
    torch.set_rng_state(state)
    assert sample(logits.clone(), seqs, [set()] * 4).token_ids == first
    draws = {tuple(sample(logits.clone(), seqs, [set()] * 4).token_ids) for _ in range(3)}
    assert len(draws) == 3


def _cpu_ops() -> Any:
    if TEST_DEVICE != "cpu":
        return None
    from sluice.kernels import cpu_fused

    return cpu_fused


def test_cpp_topk_and_block_sums_equal_torch() -> None:
    """kernels/cpu/sampling.cpp against torch: widths around the 16-lane chunks, k from 1 to V, rows with
    -inf and repeated values (ties: the lower id first)."""
    if TEST_DEVICE != "cpu":
        pytest.skip("the C++ ops are CPU ops")
    from sluice.kernels.cpu_fused import exp_block_sums, topk_rows

    rng = random.Random(fresh_seed())
    for _ in range(60):
        rows, width = rng.randint(1, 9), rng.choice([1, 7, 16, 17, 33, 256, 300, 1000, 49152])
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        logits = 3 * torch.randn(rows, width, generator=gen)
        if rng.random() < 0.3:  # few distinct values: ties everywhere
            logits = torch.randint(-3, 4, (rows, width), generator=gen).float()
        if rng.random() < 0.3 and width > 1:  # column 0 stays finite: a row's max is
            logits[rng.randrange(rows), [rng.randrange(1, width) for _ in range(width // 2 + 1)]] = float("-inf")
        k = rng.choice([1, 2, 50, 64, width])
        k = min(k, width)
        vals, ids = topk_rows(logits, k)
        want = logits.topk(k, dim=-1).values
        assert torch.equal(vals, want)
        assert torch.equal(logits.gather(1, ids), vals)
        for r in range(rows):  # ties in id order, and no id twice
            pairs = list(zip(vals[r].tolist(), ids[r].tolist(), strict=True))
            assert pairs == sorted(pairs, key=lambda p: (-p[0], p[1])) and len(set(ids[r].tolist())) == k
        shift = logits.max(dim=-1).values
        inv_t = torch.tensor([rng.choice([0.5, 1.0, 1.7]) for _ in range(rows)])
        block = rng.choice([16, 64, 256])
        got = exp_block_sums(logits, shift, inv_t, block)
        e = ((logits - shift[:, None]) * inv_t[:, None]).double().exp()
        e = torch.nn.functional.pad(e, (0, -width % block))
        assert torch.allclose(got, e.view(rows, -1, block).sum(-1), rtol=1e-5, atol=1e-30)
