"""Which adapters are loaded: at most ``capacity`` in the engine's slots (on its device, what a step's batch
may use) and at most ``host_capacity`` read and checked in CPU memory, both least recently used first out.

An adapter is read from storage (engine/lora/sources.py) into the CPU cache when a request first names it
(so a bad one fails that request), and copied into a slot when a step first runs it; a request naming one
that was read and checked before, but left the CPU cache since, has it read again when a step runs it. Neither level evicts an
adapter in ``keep`` (those of running sequences: the scheduler admits at most ``capacity`` adapters at once,
so a slot is free or can be freed when a step needs one; the CPU cache, never smaller, may hold one more while
all its entries run). A slot holds only what the CPU cache holds: leaving the one, an adapter leaves both. A
request whose adapter left the CPU cache meanwhile has it read again.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Iterable

import torch
from sluice.engine.lora.adapters import LoraAdapter, LoraError, Target, read_adapter
from sluice.engine.lora.sources import adapter_folder, check_root

# A root-resolved adapter that failed to load is refused without reading again for this long (a batch's
# thousand lines naming a missing one cost one lookup), then looked up afresh (it may have been uploaded).
ERROR_TTL_S = 30.0
MAX_REMEMBERED = 4096  # names known good or bad: lines naming ever new adapters must not grow the worker's memory
HOST_PER_SLOT = 4  # the CPU cache's default size: this many adapters per engine slot


class AdapterCache:
    """The registered adapters (name -> folder), the roots others are looked up under, and the two LRUs."""

    def __init__(self, paths: dict[str, str], capacity: int, targets: dict[str, Target], max_rank: int,
                 device: torch.device, dtype: torch.dtype, roots: Iterable[str] = (),
                 host_capacity: int | None = None) -> None:
        if capacity < 1:
            raise ValueError("max_loras must be >= 1")
        self.paths = {name: os.fspath(p) for name, p in paths.items()}
        self.roots = tuple(check_root(r) for r in roots)
        self.capacity = capacity
        self.host_capacity = max(capacity, host_capacity if host_capacity is not None else HOST_PER_SLOT * capacity)
        self.targets = targets
        self.max_rank = max_rank
        self.device, self.dtype = device, dtype
        self.resident: OrderedDict[str, LoraAdapter] = OrderedDict()  # the slots, on the engine's device
        self.host: OrderedDict[str, LoraAdapter] = OrderedDict()  # read and checked, in CPU memory
        # Adapters that failed to load: (why, when); a registered one's error is kept for good.
        self.errors: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.valid: OrderedDict[str, None] = OrderedDict()  # adapters that loaded and checked once
        self.num_loads = 0  # reads from storage
        self.num_slot_loads = 0  # copies into a slot

    @property
    def loaded(self) -> list[str]:
        """The adapters in memory (a slot or the CPU cache), sorted."""
        return sorted(set(self.host) | set(self.resident))

    def validate(self, name: str, keep: set[str] | frozenset[str] = frozenset()) -> LoraAdapter | None:
        """Raise LoraError unless requests may name ``name``: read and checked now unless it was already
        (then None if it is not in memory: it is read again when a step needs it, not now, so a queue of
        lines over more adapters than the CPU cache holds does not read each of them twice)."""
        if name in self.valid and name not in self.host:
            self.valid.move_to_end(name)
            return None
        return self.check(name, keep)

    def check(self, name: str, keep: set[str] | frozenset[str] = frozenset()) -> LoraAdapter:
        """``name``'s weights in CPU memory, read and checked against the model if they are not; LoraError
        if it is not registered, not under a root, or does not fit this model."""
        adapter = self.host.get(name)
        if adapter is not None:
            self.host.move_to_end(name)
            return adapter
        self._refuse_known_bad(name)
        try:
            with adapter_folder(name, self.paths.get(name), self.roots) as (where, folder):
                adapter = read_adapter(name, folder, self.targets, self.max_rank, torch.device("cpu"), self.dtype,
                                       where)
        except LoraError as e:  # read again and broken now: its next request fails at once, with the reason
            self.valid.pop(name, None)
            self._remember(name, str(e))
            raise
        self.num_loads += 1
        self.errors.pop(name, None)
        self.valid[name] = None
        self.valid.move_to_end(name)
        while len(self.valid) > MAX_REMEMBERED:
            self.valid.popitem(last=False)
        for gone in self._evict(self.host, self.host_capacity - 1, keep):
            self.resident.pop(gone, None)  # a slot holds only what the CPU cache holds
        self.host[name] = adapter
        return adapter

    def get(self, name: str, keep: set[str]) -> LoraAdapter:
        """``name``'s weights in a slot, copied there (from the CPU cache, read again if it left it) if they are
        not, in place of the least recently used adapter not in ``keep``."""
        adapter = self.resident.get(name)
        if adapter is not None:
            self.resident.move_to_end(name)
            if name in self.host:
                self.host.move_to_end(name)
            return adapter
        host = self.check(name, keep)
        self._evict(self.resident, self.capacity - 1, keep)
        self.resident[name] = host.to(self.device)
        self.num_slot_loads += 1
        return self.resident[name]

    def _refuse_known_bad(self, name: str) -> None:
        if name not in self.paths and not self.roots:
            known = ", ".join(sorted(self.paths)) or "none"
            raise LoraError(f"unknown LoRA adapter {name!r} (this engine serves: {known})")
        known_bad = self.errors.get(name)
        if known_bad is not None and (name in self.paths or time.monotonic() - known_bad[1] < ERROR_TTL_S):
            raise LoraError(known_bad[0])

    def _remember(self, name: str, error: str) -> None:
        self.errors[name] = (error, time.monotonic())
        self.errors.move_to_end(name)
        while len(self.errors) > MAX_REMEMBERED:
            self.errors.popitem(last=False)

    @staticmethod
    def _evict(lru: OrderedDict[str, LoraAdapter], size: int, keep: set[str] | frozenset[str]) -> list[str]:
        """Drop least recently used entries not in ``keep`` until at most ``size`` remain (or only kept ones);
        the names dropped."""
        gone = []
        for old in list(lru):
            if len(lru) <= size:
                break
            if old not in keep:
                del lru[old]
                gone.append(old)
        return gone
