"""CPU memory for the KV cache on transparent huge pages.

Attention reads the paged cache a block at a time from wherever each block lies, and at SmolLM2's
shapes one head's block is one 4 KiB page, so with small pages nearly every block read begins with a
TLB miss. Most distributions set THP to "madvise": only ranges that ask get 2 MiB pages, and only
pages not yet touched. So the cache gets a fresh anonymous mapping of its own (memory from the
allocator may be reused, already-touched heap), advised before first use.
"""

from __future__ import annotations

import math
import mmap

import torch

_HUGE = 2 << 20


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor on its own 2 MiB-aligned mapping, advised MADV_HUGEPAGE (a plain
    ``torch.empty`` where the platform has no such advice). The tensor keeps the mapping alive."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem: no THP
    mapping.madvise(advice)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    start = -raw.data_ptr() % _HUGE
    return raw[start : start + nbytes].view(dtype).view(shape)
