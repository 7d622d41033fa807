"""The engine's LoRA state: the registered adapters, their hooks in the model, the step's row groups."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from sluice.engine.lora.adapters import LoraAdapter, LoraError, Target
from sluice.engine.lora.batch import adapter_runs
from sluice.engine.lora.cache import AdapterCache
from sluice.engine.lora.layers import (
    CpuStep,
    KernelStep,
    LoraHook,
    LoraStep,
    Site,
    native_targets,
    transformers_targets,
)
from torch import nn


class LoraManager:
    def __init__(self, net: nn.Module, impl: str, paths: dict[str, str], max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype, roots: Iterable[str] = (),
                 max_cpu_loras: int | None = None) -> None:
        """Built before anything replaces the model's linear layers: the targets' widths are read here."""
        self.net = net
        sites = native_targets(net) if impl == "native" else transformers_targets(net)
        targets: dict[str, Target] = {name: t for name, (t, _) in sites.items()}
        self.sites: dict[str, Site] = {name: s for name, (_, s) in sites.items()}
        self.cache = AdapterCache(paths, max_loras, targets, max_rank, device, dtype, roots, max_cpu_loras)
        # The adapters of running sequences (the engine sets it to the scheduler's): never evicted.
        self.in_use: Callable[[], set[str]] = set
        self.device = device
        # CUDA: the Triton kernel (kernels/lora.py), one launch per target for every adapter's rows (tests
        # turn it on on CPU, under the interpreter). CPU: the C++ op, one call per layer, where the engine
        # runs the C++ ops (it says so once they are loaded); else a matmul pair per row group.
        self.use_kernel = device.type == "cuda"
        self.use_cpu_op = False
        self.hooks: dict[str, LoraHook] = {}  # module path -> its hook
        self.hooked_targets: set[str] = set()
        # The most targets one hooked module serves (q/k/v: 3), for the shrinks' scratch buffer.
        self.max_targets_per_hook = max(Counter(s.module for s in self.sites.values()).values(), default=1)
        self.scratch = torch.empty(0, dtype=dtype, device=device)
        self.prompt_tokens: Counter[str] = Counter()  # per adapter, of finished requests
        self.completion_tokens: Counter[str] = Counter()

    @property
    def names(self) -> list[str]:
        """The adapters requests may name without a lookup: the registered ones and those loaded now."""
        return sorted(set(self.cache.paths) | set(self.cache.loaded))

    @property
    def registered(self) -> list[str]:
        return sorted(self.cache.paths)

    @property
    def dynamic(self) -> bool:
        """Whether adapters not registered are looked up under adapter roots."""
        return bool(self.cache.roots)

    @property
    def max_loras(self) -> int:
        return self.cache.capacity

    def check(self, name: str) -> None:
        """Raise LoraError unless requests may name ``name`` (registered or under a root, and loads against the
        model); read into the CPU cache if it is not there."""
        adapter = self.cache.validate(name, self.in_use())
        if adapter is not None:  # None: checked and hooked before
            self._hook(adapter)

    def prepare(self, names: Sequence[str | None]) -> dict[str, str]:
        """Read into the CPU cache the step's adapters that left it; those that fail now -> the reason."""
        used = {n for n in names if n is not None}
        keep = used | self.in_use()
        broken = {}
        for name in used:
            try:
                self.cache.check(name, keep)
            except LoraError as e:
                broken[name] = str(e)
        return broken

    def begin_step(self, names: Sequence[str | None], q_lens: Sequence[int]) -> None:
        """Tell the hooks which packed rows take which adapter in the coming forward pass (fastest with the
        sequences in ``adapter_order``: one run per adapter)."""
        runs = adapter_runs(names, q_lens)
        step = None
        if runs:
            used = dict.fromkeys(name for name, _, _ in runs)
            keep = set(used) | self.in_use()
            adapters = {}
            for name in used:
                adapter = adapters[name] = self.cache.get(name, keep)
                self._hook(adapter)
            longest = max(end - start for _, start, end in runs)
            kernel = self._kernel_step(runs, list(adapters.values()), sum(q_lens)) if self.use_kernel else None
            cpu = self._cpu_step(runs, list(adapters.values())) if self.use_cpu_op and not self.use_kernel else None
            step = LoraStep([(adapters[n], start, end) for n, start, end in runs], self._scratch(longest), kernel, cpu)
        for hook in self.hooks.values():
            hook.step = step

    def _scratch(self, rows: int) -> torch.Tensor:
        """A flat buffer for ``rows`` rows of any hook's stacked shrink, kept between steps (grown as needed)."""
        need = rows * self.cache.max_rank * self.max_targets_per_hook
        if self.scratch.numel() < need:
            self.scratch = torch.empty(need, dtype=self.cache.dtype, device=self.device)
        return self.scratch

    def _cpu_step(self, runs: list[tuple[str, int, int]], adapters: list[LoraAdapter]) -> CpuStep:
        slot = {a.name: i for i, a in enumerate(adapters)}
        table = torch.tensor([(start, end, slot[name]) for name, start, end in runs], dtype=torch.int64)
        return CpuStep(adapters, table, tuple(a.key for a in adapters))

    def _kernel_step(self, runs: list[tuple[str, int, int]], adapters: list[LoraAdapter], num_rows: int) -> KernelStep:
        slot = {a.name: i for i, a in enumerate(adapters)}
        slots = np.full(num_rows, -1, dtype=np.int32)
        for name, start, end in runs:
            slots[start:end] = slot[name]
        return KernelStep(adapters, torch.from_numpy(slots).to(self.device))

    def count(self, name: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.prompt_tokens[name] += prompt_tokens
        self.completion_tokens[name] += completion_tokens

    def _hook(self, adapter: LoraAdapter) -> None:
        """Make sure every layer ``adapter`` targets has a hook that knows the target's columns."""
        for target in adapter.modules:
            if target in self.hooked_targets:
                continue
            site = self.sites[target]
            hook = self.hooks.get(site.module)
            if hook is None:
                hook = self.hooks[site.module] = LoraHook()
                self.net.get_submodule(site.module).register_forward_hook(hook)
            hook.parts.append((target, site.offset, site.width))
            self.hooked_targets.add(target)
