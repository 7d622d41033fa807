"""``--dtype auto`` on CPU: chosen by measurement, with the reason given."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import LlamaConfig

from engine import cpu_dtype

TINY = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)


def test_without_bf16_instructions_float32_is_chosen_unmeasured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: {"avx2", "fma"})
    dtype, why = cpu_dtype.pick_cpu_dtype(TINY)
    assert dtype == torch.float32
    assert "no bfloat16 instructions" in why


def test_the_choice_follows_the_measured_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: {"avx512_bf16"})
    dtype, why = cpu_dtype.pick_cpu_dtype(TINY)
    f32, bf16 = (float(x) for x in re.findall(r"([\d.]+) ms in (?:float32|bfloat16)", why))
    assert dtype == (torch.bfloat16 if bf16 * cpu_dtype.MARGIN < f32 else torch.float32), why
