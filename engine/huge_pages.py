"""Ask Linux to back the CPU KV cache with transparent huge pages.

Attention reads the paged cache a block at a time from wherever each block lies, and at SmolLM2's
shapes one head's block is one 4 KiB page, so with small pages nearly every block read begins with a
TLB miss. Most distributions set THP to "madvise": only ranges that ask get 2 MiB pages.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

log = logging.getLogger(__name__)

_HUGE = 2 << 20


def advise_huge_pages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the 2 MiB-aligned part of ``t``'s storage; call it before the memory
    is first written. Returns whether the kernel accepted the advice (False on other systems)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if t.device.type != "cpu" or advice is None:
        return False
    start = t.untyped_storage().data_ptr()
    lo = -(-start // _HUGE) * _HUGE
    hi = (start + t.untyped_storage().nbytes()) // _HUGE * _HUGE
    if hi <= lo:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if libc.madvise(lo, hi - lo, advice) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True
