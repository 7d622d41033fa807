"""The CPU KV cache asks for transparent huge pages and gets them, at allocation, where the kernel allows it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sluice.engine.attention import allocate_kv, head_major

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off here")
def test_kv_cache_is_backed_by_huge_pages() -> None:
    # As in a long process (a worker, this suite): a freed 16 MiB tensor raises malloc's mmap threshold,
    # so smaller ones come from the heap and leave touched pages behind; advice on memory malloc hands
    # out again would change nothing, so the cache must not come from malloc.
    big = torch.ones(4 << 20)
    del big
    junk = [torch.ones(3 << 20) for _ in range(4)]
    del junk
    before = _anon_huge_kb()
    cache = allocate_kv(512, 16, 4, 64, torch.float32, torch.device("cpu"))  # 8 MiB
    # Faulted in by the allocation itself (zeroed), not by the first decode steps that write to it.
    gained = _anon_huge_kb() - before
    assert gained >= 6 * 1024, f"only {gained} kB of the 8 MiB cache is on huge pages once allocated"
    assert not cache.any()
    head_major(cache).fill_(1.0)
    assert float(cache.sum()) == cache.numel()  # still an ordinary tensor
