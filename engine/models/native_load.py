"""The native model straight from a checkpoint's safetensors files, without building transformers' model.

transformers' ``from_pretrained`` imports its modelling code and builds its own model only for the native
model to copy every weight out of it again (seconds of a warm start-up). Here each tensor is read from the
memory-mapped files once and copied into the native model's (uninitialised) parameters. Anything this path
does not cover (no safetensors files, a name or shape it does not know, a weight missing) returns None with
the reason logged, and the caller loads through transformers as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from sluice.engine.models import llama

log = logging.getLogger(__name__)


def safetensors_files(path: str) -> list[Path] | None:
    """The checkpoint's safetensors files: those its index names, else a lone ``model.safetensors``; None
    where the directory holds neither (a .bin checkpoint, a hub id)."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError):
            return None
        return [root / n for n in names]
    single = root / "model.safetensors"
    return [single] if single.is_file() else None


def _tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in files:
        # Each tensor maps its bytes of the file copy-on-write (private): nothing is read until used, and the
        # dense cache replaces a file by renaming a new one in, never by rewriting it in place.
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is no dict: keys() is its API
                yield name, f.get_tensor(name)


def load_native(path: str, config: Any, max_positions: int, device: torch.device,
                dtype: torch.dtype) -> llama.LlamaForCausalLM | None:
    """The native model of ``config`` with the weights of the checkpoint directory ``path``, or None (see the
    module's docstring)."""
    if config.model_type not in llama.SUPPORTED:
        return None
    files = safetensors_files(path)
    if files is None:
        log.info("loading through transformers: no safetensors files in %s", path)
        return None
    net = llama.build_model(config, max_positions, device, dtype)
    from safetensors import SafetensorError

    try:
        filled = net.load_weights(_tensors(files), take=True)  # each tensor read is ours alone
    except (KeyError, RuntimeError, OSError, SafetensorError) as e:
        log.warning("loading through transformers: reading %s natively failed (%s: %s)", path,
                    type(e).__name__, e)
        return None
    missing = [name for name, p in net.named_parameters() if filled.get(name, 0) != p.numel()]
    if missing:
        log.warning("loading through transformers: %s lacks weights for %s", path, ", ".join(missing[:5]))
        return None
    return net.eval()
