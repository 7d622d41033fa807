"""Random LoRA adapters saved the way peft saves them, and peft's own model over them as the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_adapter(base: Path, path: Path, seed: int, r: int, targets: list[str], alpha: float = 16.0,
                 rslora: bool = False, std: float = 0.1) -> Path:
    """A random adapter over the model at ``base``, saved with peft's ``save_pretrained``. Both halves
    are random (peft's default zero B would leave the base's outputs unchanged)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(path)
    return path


def peft_model(base: Path, adapter: Path) -> Any:
    """peft's model: a fresh copy of the base with the adapter loaded by ``PeftModel.from_pretrained``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(hf, adapter).eval()


def merged_model(base: Path, adapter: Path) -> Any:
    """peft's model with the adapter merged into the base's weights (``merge_and_unload``): the reference."""
    return peft_model(base, adapter).merge_and_unload().eval()
