"""``--dtype auto`` on CPU: chosen by measurement, with the reason given."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from sluice.engine import cpu_dtype, tuning_cache
from transformers import LlamaConfig

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


def test_a_disturbed_timing_decides_this_run_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Runs that vary (other work on the machine) are not cached; steady ones are, and are reused."""
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: {"avx512_bf16"})
    assert cpu_dtype.steady([1.0, 1.1, 1.2, 5.0]) and not cpu_dtype.steady([1.0, 2.0, 3.0])
    calls: list[bool] = []

    def measure(config: Any, cpu_linear: str, flags: set[str]) -> tuple[torch.dtype, str, bool]:
        calls.append(True)
        return torch.bfloat16, "timed", len(calls) > 1  # busy the first time, steady the second

    monkeypatch.setattr(cpu_dtype, "_measure", measure)
    dtype, why = cpu_dtype.pick_cpu_dtype(TINY)
    assert dtype == torch.bfloat16 and "not kept" in why and not list(tuning_cache.directory().rglob("*.json"))
    assert cpu_dtype.pick_cpu_dtype(TINY) == (torch.bfloat16, "timed") and len(calls) == 2
    dtype, why = cpu_dtype.pick_cpu_dtype(TINY)  # the steady timing was kept: no third measurement
    assert dtype == torch.bfloat16 and "measured earlier" in why and len(calls) == 2
