"""Seeded rows' Exp(1) noise in one launch (kernels/sampling.py, the Triton kernel the sampler used on
CUDA before its counter-based noise, engine/counter_rng.py), run under the Triton interpreter here: keyed
by (seed, draw) alone; its distribution is Exp(1)."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import torch
from helpers import TEST_DEVICE, fresh_seed

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
