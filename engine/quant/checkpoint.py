"""A quantized checkpoint's own scales, read from its safetensors files: the native path divides the
dequantized weights transformers loads by them, so it holds the checkpoint's int8 values exactly."""

from __future__ import annotations

from pathlib import Path

import torch


def _files(path: str) -> list[Path]:
    local = Path(path)
    if not local.is_dir():  # a hub id: its snapshot in the local cache (nothing is downloaded here)
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(path, local_files_only=True))
    return sorted(local.glob("*.safetensors"))


def read_weight_scales(path: str) -> dict[str, torch.Tensor]:
    """Every ``*.weight_scale`` tensor of the checkpoint at ``path``, by name."""
    from safetensors import safe_open

    scales: dict[str, torch.Tensor] = {}
    for f in _files(path):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if key.endswith(".weight_scale"):
                    scales[key] = st.get_tensor(key)
    if not scales:
        raise ValueError(f"{path} has no weight_scale tensors: not a compressed-tensors int8 checkpoint")
    return scales
