"""engine/tuning_cache.py: start-up measurements (the GEMM path, --dtype auto) kept across runs, keyed by
what they depend on; an unreadable, foreign or stale entry is measured again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sluice.engine import cpu_dtype, linear, tuning_cache
from transformers import LlamaConfig

TINY = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                   num_hidden_layers=2, vocab_size=512)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SLUICE_HOME", str(tmp_path))
    monkeypatch.delenv("SLUICE_TUNING_CACHE", raising=False)
    linear.choose.cache_clear()
    yield tmp_path
    linear.choose.cache_clear()


def test_an_entry_is_read_back_only_under_its_own_key(home: Path) -> None:
    assert tuning_cache.get("gemm", {"dtype": "float32"}) is None
    tuning_cache.put("gemm", {"dtype": "float32"}, ["onednn-packed", "why"])
    value, path = tuning_cache.get("gemm", {"dtype": "float32"})
    assert value == ["onednn-packed", "why"] and path.parent == home / "cache" / "tuning"
    assert tuning_cache.get("gemm", {"dtype": "bfloat16"}) is None
    assert tuning_cache.get("dtype", {"dtype": "float32"}) is None


def test_a_corrupt_or_foreign_entry_is_a_miss(home: Path) -> None:
    tuning_cache.put("gemm", {"n": 1}, ["aten", "why"])
    _, path = tuning_cache.get("gemm", {"n": 1})
    path.write_text('{"key": ')  # torn
    assert tuning_cache.get("gemm", {"n": 1}) is None
    entry = {"key": {"version": tuning_cache.VERSION, "kind": "gemm", "machine": {"cpu": "another"}, "parts": {"n": 1}},
             "value": ["onednn-packed", "why"]}
    path.write_text(json.dumps(entry))  # a collision, or another machine's file copied in
    assert tuning_cache.get("gemm", {"n": 1}) is None
    tuning_cache.put("gemm", {"n": 1}, ["aten", "again"])
    assert tuning_cache.get("gemm", {"n": 1})[0] == ["aten", "again"]


def test_switched_off_nothing_is_read_or_written(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_TUNING_CACHE", "off")
    tuning_cache.put("gemm", {"n": 2}, ["aten", "why"])
    assert not (home / "cache").exists() and tuning_cache.get("gemm", {"n": 2}) is None


def test_the_gemm_choice_is_measured_once_then_read(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = linear.model_gemm_shapes(TINY)
    first = linear.choose(shapes, torch.float32)
    linear.choose.cache_clear()  # a new process
    monkeypatch.setattr(linear, "time_gemms", lambda *a, **k: pytest.fail("measured again"))
    pick, why = linear.choose(shapes, torch.float32)
    assert pick == first[0] and why.startswith(first[1]) and "measured earlier" in why


def test_a_stale_gemm_choice_is_measured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    shapes = linear.model_gemm_shapes(TINY)
    linear.choose(shapes, torch.float32)
    for entry in (Path(tuning_cache.directory())).glob("gemm-*.json"):
        data = json.loads(entry.read_text())
        entry.write_text(json.dumps({**data, "value": ["no-such-gemm", "why"]}))
    linear.choose.cache_clear()
    measured = []
    real = linear.time_gemms
    monkeypatch.setattr(linear, "time_gemms", lambda *a, **k: measured.append(1) or real(*a, **k))
    pick, why = linear.choose(shapes, torch.float32)
    assert measured and pick in linear.candidates(torch.float32) and "measured earlier" not in why


def test_the_dtype_choice_is_measured_once_then_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_dtype, "cpu_flags", lambda: {"avx512_bf16"})
    # The tiny layer runs in microseconds, so its repeats vary on any machine: this test is about the
    # cache, not the steadiness check (tests/engine/test_cpu_dtype.py covers that), so every timing counts as steady.
    monkeypatch.setattr(cpu_dtype, "steady", lambda times: True)
    dtype, why = cpu_dtype.pick_cpu_dtype(TINY)
    linear.choose.cache_clear()
    monkeypatch.setattr(cpu_dtype, "_decode_layer", lambda *a: pytest.fail("measured again"))
    again, why_again = cpu_dtype.pick_cpu_dtype(TINY)
    assert again == dtype and why_again.startswith(why) and "measured earlier" in why_again
    wider = LlamaConfig(**{**TINY.to_dict(), "intermediate_size": 512})  # another model: its own measurement
    monkeypatch.setattr(cpu_dtype, "_decode_layer", lambda *a: (_ for _ in ()).throw(RuntimeError("measured")))
    with pytest.raises(RuntimeError, match="measured"):
        cpu_dtype.pick_cpu_dtype(wider)
