"""LoRA adapters: read from a peft folder, checked against the base model, kept in an LRU.

An adapter is peft's ``adapter_config.json`` + ``adapter_model.safetensors`` (read with peft's own
helpers). Each target module ``m`` gets ``y = base(x) + (x @ A^T @ B^T) * scale`` with scale
``alpha / r`` (``alpha / sqrt(r)`` under rslora); dropout is a training-time thing and is ignored.
Anything peft can save that this delta does not express (DoRA, biases, embeddings, modules_to_save,
per-module alphas) is refused with a one-line reason rather than run wrongly.
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
# peft prefixes saved keys with its wrapper's path; the rest is the base model's module name.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the reason, in one line."""


@dataclass(frozen=True)
class Target:
    """A base linear layer an adapter may target: its input and output widths."""

    in_features: int
    out_features: int


@dataclass
class LoraWeights:
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest module rank
    modules: dict[str, LoraWeights]  # base module name (transformers' naming) -> weights
    fused: dict[int, Any] = field(default_factory=dict)  # per hooked layer: its targets' weights combined


def read_adapter(name: str, path: str, targets: dict[str, Target], max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> LoraAdapter:
    """Load and check one adapter; a LoraError says why it cannot be served."""
    if not (Path(path) / CONFIG_FILE).is_file():
        raise LoraError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {path}")
    require_peft()
    from peft import LoraConfig

    try:
        config = LoraConfig.from_pretrained(path)
        state = _read_weights(path)
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file (safetensors' own errors too) fails its lines only
        raise LoraError(f"LoRA adapter {name!r}: cannot read {path}: {_one_line(e)}") from None
    _check_config(name, config)
    pairs = _pairs(name, state)
    modules = {}
    for module, (a, b) in pairs.items():
        _check_shapes(name, module, a, b, targets, max_rank)
        r = a.shape[0]
        scale = config.lora_alpha / (math.sqrt(r) if config.use_rslora else r)
        modules[module] = LoraWeights(a.to(device=device, dtype=dtype).contiguous(),
                                      b.to(device=device, dtype=dtype).contiguous(), scale)
    if not modules:
        raise LoraError(f"LoRA adapter {name!r}: no LoRA weights in {path}")
    return LoraAdapter(name, str(path), max(w.a.shape[0] for w in modules.values()), modules)


def require_peft() -> None:
    """Raise LoraError, in one line, unless peft (which reads the adapters) can be imported."""
    try:
        import peft  # noqa: F401
    except ImportError as e:
        raise LoraError(f"LoRA adapters need peft, which cannot be imported here ({_one_line(e)}): "
                        f"pip install 'sluice-llm[lora]'") from None


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """The adapter's tensors, copied into memory: safetensors' own loader keeps them on a memory map of
    the file, so rewriting a served adapter's file would change the weights in use, or kill the process
    with SIGBUS when the file got shorter. A ``.bin`` (torch.load) is read into memory already."""
    from safetensors.torch import load

    weights = Path(path) / SAFETENSORS_FILE
    if weights.is_file():
        return load(weights.read_bytes())
    from peft.utils import load_peft_weights

    return load_peft_weights(path, device="cpu")


def _check_config(name: str, config: Any) -> None:
    refused = {
        "use_dora": "DoRA",
        "lora_bias": "LoRA biases",
        "modules_to_save": "modules_to_save (fully trained modules)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layer_replication": "layer replication",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    }
    for option, what in refused.items():
        if getattr(config, option, None):
            raise LoraError(f"LoRA adapter {name!r} uses {what}, which Sluice does not support")
    if getattr(config, "bias", "none") != "none":
        raise LoraError(f"LoRA adapter {name!r} trains biases (bias={config.bias!r}), which Sluice does not support")


def _pairs(name: str, state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.match(key)
        if m is None:
            raise LoraError(f"LoRA adapter {name!r}: weight {key!r} is not a linear layer's lora_A/lora_B")
        halves.setdefault(m["module"], {})[m["ab"]] = tensor
    for module, h in halves.items():
        if set(h) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: {module} has lora_{''.join(h)} without its pair")
    return {module: (h["A"], h["B"]) for module, h in halves.items()}


def _check_shapes(name: str, module: str, a: torch.Tensor, b: torch.Tensor, targets: dict[str, Target],
                  max_rank: int) -> None:
    target = targets.get(module)
    if target is None:
        raise LoraError(f"LoRA adapter {name!r} targets {module}, which is not a linear layer this model's "
                        f"LoRA path serves")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
        raise LoraError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                        f"which do not chain")
    if a.shape[1] != target.in_features or b.shape[0] != target.out_features:
        raise LoraError(f"LoRA adapter {name!r}: {module} is {target.in_features} -> {target.out_features} in this "
                        f"model but the adapter's is {a.shape[1]} -> {b.shape[0]} (another base model?)")
    if a.shape[0] > max_rank:
        raise LoraError(f"LoRA adapter {name!r}: {module} has rank {a.shape[0]} > max_lora_rank {max_rank}")


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class AdapterCache:
    """The registered adapters (name -> folder) and an LRU of at most ``capacity`` of them in memory."""

    def __init__(self, paths: dict[str, str], capacity: int, targets: dict[str, Target], max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        if capacity < 1:
            raise ValueError("max_loras must be >= 1")
        self.paths = {name: os.fspath(p) for name, p in paths.items()}
        self.capacity = capacity
        self.targets = targets
        self.max_rank = max_rank
        self.device, self.dtype = device, dtype
        self.resident: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.errors: dict[str, str] = {}  # adapters that failed to load: refused without reading again
        self.checked: set[str] = set()  # adapters that loaded once: a request for one is not read again
        self.num_loads = 0

    def check(self, name: str) -> None:
        """Raise LoraError unless ``name`` is registered and loads against this model (read once)."""
        if name not in self.paths:
            known = ", ".join(sorted(self.paths)) or "none"
            raise LoraError(f"unknown LoRA adapter {name!r} (this engine serves: {known})")
        if name in self.errors:
            raise LoraError(self.errors[name])
        if name not in self.checked:
            self.get(name, set())

    def load_once(self, name: str) -> LoraAdapter | None:
        """Check ``name`` (see ``check``); its weights if this call loaded them for the first time."""
        first = name not in self.checked
        self.check(name)
        return self.resident[name] if first else None

    def get(self, name: str, keep: set[str]) -> LoraAdapter:
        """``name``'s weights, loading them (and evicting the least recently used adapter not in ``keep``)
        if they are not in memory."""
        adapter = self.resident.get(name)
        if adapter is not None:
            self.resident.move_to_end(name)
            return adapter
        try:
            adapter = read_adapter(name, self.paths[name], self.targets, self.max_rank, self.device, self.dtype)
        except LoraError as e:
            self.errors[name] = str(e)
            raise
        self.num_loads += 1
        self.checked.add(name)
        for old in list(self.resident):
            if len(self.resident) < self.capacity:
                break
            if old not in keep:
                del self.resident[old]
        self.resident[name] = adapter
        return adapter
