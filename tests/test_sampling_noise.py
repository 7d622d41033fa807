"""Seeded rows' Exp(1) noise in one launch (kernels/sampling.py, the sampler's path on CUDA), run under
the Triton interpreter here: keyed by (seed, draw) alone, so a seeded request samples the same tokens in
any batch; its distribution is Exp(1); and the sampler takes it where the device is enabled for it."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import torch
from helpers import TEST_DEVICE, fresh_seed

from engine import sampler
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kernels.sampling import philox_keys, seeded_exponential


@pytest.fixture(autouse=True)
def on_test_device() -> Iterator[None]:
    with torch.device(TEST_DEVICE):
        yield


def _noise(n_rows: int, vocab: int, rows: list[int], keys: list[int]) -> torch.Tensor:
    out = torch.full((n_rows, vocab), -1.0)
    return seeded_exponential(out, torch.tensor(rows), torch.tensor(keys))


def test_noise_depends_on_the_key_alone() -> None:
    rng = random.Random(fresh_seed())
    vocab = rng.randint(1500, 3000)  # more than one tile of 1024, not a multiple of it
    seeds = [rng.randrange(2**40) for _ in range(3)]
    keys = philox_keys(seeds, [0, 5, 5])
    alone = _noise(1, vocab, [0], keys[1:2])[0]
    batch = _noise(5, vocab, [4, 1, 2], keys)
    assert torch.equal(batch[1], alone)  # the same row wherever it sits, whatever shares the launch
    assert (batch[[0, 3]] == -1).all()  # rows not asked for are left alone
    assert (batch[[4, 1, 2]] > 0).all() and torch.isfinite(batch).all()
    again = _noise(1, vocab, [0], philox_keys([seeds[1]], [6]))[0]
    assert not torch.equal(again, alone)  # the next draw differs
    other = _noise(1, vocab, [0], philox_keys([seeds[1] + 1], [5]))[0]
    assert not torch.equal(other, alone)  # and so does the next seed


def test_noise_is_exponential() -> None:
    rng = random.Random(fresh_seed())
    x = _noise(4, 16384, [0, 1, 2, 3], philox_keys([rng.randrange(2**32)] * 4, [0, 1, 2, 3])).flatten().double()
    # 65536 draws of Exp(1): mean 1 and variance 1 (standard errors 0.004 and 0.01), P(x > 1) = 1/e.
    assert abs(float(x.mean()) - 1) < 0.03 and abs(float(x.var()) - 1) < 0.08
    assert abs(float((x > 1).double().mean()) - math.exp(-1)) < 0.01


def _seq(i: int, prompt: list[int], params: SamplingParams) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(prompt), len(prompt), params)


def test_the_sampler_draws_seeded_rows_in_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernel path enabled here: a seeded row samples the same token alone and in a batch, and
    draws anew as it grows; a launch per step however many rows are seeded."""
    monkeypatch.setattr(sampler, "SEEDED_KERNEL_DEVICES", {"cpu", "cuda"})
    calls: list[int] = []
    real = seeded_exponential

    def counting(out: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        calls.append(rows.numel())
        return real(out, rows, keys)

    monkeypatch.setattr("kernels.sampling.seeded_exponential", counting)
    rng = random.Random(fresh_seed())
    vocab = 300
    flat = torch.zeros(1, vocab)  # uniform: the token is the noise's own choice
    params = SamplingParams(temperature=1.0, seed=rng.randrange(10**6))
    mine = _seq(0, [5, 6], params)
    alone = [sample(flat.clone(), [mine], [set()]).token_ids[0]]
    others = [_seq(i, [7], SamplingParams(temperature=1.0, seed=i)) for i in range(1, 4)]
    greedy = _seq(9, [1], SamplingParams())
    batched = sample(torch.zeros(5, vocab), [others[0], greedy, mine, *others[1:]], [set()] * 5).token_ids[2]
    assert batched == alone[0]
    assert calls == [1, 4]  # one launch each step: 1 seeded row, then 4
    draws = set()
    for _ in range(8):  # the row grows: each draw is keyed anew
        tok = sample(flat.clone(), [mine], [set()]).token_ids[0]
        draws.add(tok)
        mine.token_ids.append(tok)
    assert len(draws) > 1
