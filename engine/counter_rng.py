"""Counter-based random numbers for sampling: a pure function of (row key, counter), vectorised in torch.

A seeded request's row key mixes its seed (plus its sample index) and its draw number (how many tokens it
has sampled), so its draws depend on neither what shares the batch nor the step it runs in, and a
sequence recomputed after preemption draws again what it drew before. The counter is a token id (the
noise of the exponential race) or -1 (the one uniform of an inverse-CDF draw). Numbers are SplitMix64
outputs: the host mixes the keys in Python integers, the device mixes (key, counter) pairs in int64
tensors (multiplies wrap; right shifts are made logical with a mask), on any device, with no generator
state and no per-row call.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15
M1 = 0xBF58476D1CE4E5B9
M2 = 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 value torch stores for it."""
    return x - (1 << 64) if x >= 1 << 63 else x


def mix64(x: int) -> int:
    """SplitMix64's output function on a Python integer (the reference for ``mix64_tensor``)."""
    x &= MASK64
    x = ((x ^ (x >> 30)) * M1) & MASK64
    x = ((x ^ (x >> 27)) * M2) & MASK64
    return x ^ (x >> 31)


def row_key(seed: int, draw: int) -> int:
    """The int64 key of draw number ``draw`` of the stream seeded ``seed``: distinct pairs, unrelated keys."""
    return _signed(mix64(mix64(seed + GAMMA) ^ (draw & MASK64)))


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """``mix64`` elementwise on an int64 tensor of bit patterns."""
    z = (z ^ _srl(z, 30)) * _signed(M1)
    z = (z ^ _srl(z, 27)) * _signed(M2)
    return z ^ _srl(z, 31)


def uniform(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1), one per (``keys`` [R, 1], ``counters`` [R, C]) pair: position
    ``counter + 1`` of the SplitMix64 stream whose state is the key, 53 bits, never 0 or 1."""
    z = mix64_tensor(keys + (counters + 1) * _signed(GAMMA))
    return (_srl(z, 11).double() + 0.5) * 2.0**-53


def exponential(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """float64 Exp(1) draws shaped like ``counters`` (see ``uniform``)."""
    return uniform(keys, counters).log_().neg_()
