"""LoRA adapters: read from a peft folder, checked against the base model, kept in an LRU.

An adapter is peft's ``adapter_config.json`` + ``adapter_model.safetensors`` (read with peft's own
helpers). Each target module ``m`` gets ``y = base(x) + (x @ A^T @ B^T) * scale`` with scale
``alpha / r`` (``alpha / sqrt(r)`` under rslora); dropout is a training-time thing and is ignored.
Anything peft can save that this delta does not express (DoRA, biases, embeddings, modules_to_save,
per-module alphas) is refused with a one-line reason rather than run wrongly.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"  # peft's older format, read for registered folders (torch.load, no hub lookup)
# peft prefixes saved keys with its wrapper's path; the rest is the base model's module name.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


_serials = itertools.count()


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
    # One per read from storage (copies on another device keep it): what the hooks key their stacked weights
    # by, so an adapter read again under the same name (its files rewritten meanwhile) is restacked.
    serial: int = field(default_factory=lambda: next(_serials))

    @property
    def key(self) -> tuple[str, int]:
        return self.name, self.serial

    def to(self, device: torch.device) -> LoraAdapter:
        """A copy on ``device`` (itself if it is there already), with the same serial."""
        if all(w.a.device == device for w in self.modules.values()):
            return self
        modules = {m: LoraWeights(w.a.to(device), w.b.to(device), w.scale) for m, w in self.modules.items()}
        return LoraAdapter(self.name, self.path, self.rank, modules, serial=self.serial)

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())


def read_adapter(name: str, path: str, targets: dict[str, Target], max_rank: int, device: torch.device,
                 dtype: torch.dtype, where: str | None = None) -> LoraAdapter:
    """Load and check one adapter from the local folder ``path`` (``where``: the place errors name, when
    the folder is a copy); a LoraError says why it cannot be served."""
    where = where or path
    if not (Path(path) / CONFIG_FILE).is_file():
        raise LoraError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {where}")
    if not any((Path(path) / f).is_file() for f in (SAFETENSORS_FILE, BIN_FILE)):
        raise LoraError(f"LoRA adapter {name!r}: no {SAFETENSORS_FILE} in {where}")
    require_peft()
    from peft import LoraConfig

    try:
        config = LoraConfig.from_pretrained(path)
        state = _read_weights(path)
    except Exception as e:  # noqa: BLE001 - a corrupt or foreign file (safetensors' own errors too) fails its lines only
        raise LoraError(f"LoRA adapter {name!r}: cannot read {where}: {one_line(e)}") from None
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
        raise LoraError(f"LoRA adapter {name!r}: no LoRA weights in {where}")
    return LoraAdapter(name, where, max(w.a.shape[0] for w in modules.values()), modules)


def require_peft() -> None:
    """Raise LoraError, in one line, unless peft (which reads the adapters) can be imported."""
    try:
        import peft  # noqa: F401
    except ImportError as e:
        raise LoraError(f"LoRA adapters need peft, which cannot be imported here ({one_line(e)}): "
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


def one_line(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__
