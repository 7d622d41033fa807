"""engine/loader.py's dense copies of GGUF models: made once, keyed by the file and the dequantizing code,
made again when the key changes, and never read when a copy no longer matches its manifest.

Dequantizing a real GGUF takes tens of seconds (the engine tests do it for the default model); here the
dequantizing step writes a tiny saved model instead, and counts its calls: the cache around it is real."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
from sluice.engine import loader
from sluice.engine.loader import MANIFEST, ModelSource, dense_path
from transformers import AutoConfig


@pytest.fixture
def made(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Where each dequantizing call wrote its copy."""
    calls: list[Path] = []

    def dequantize(src: ModelSource, out: Path) -> None:
        calls.append(out)
        shutil.copytree(tiny_model_dir, out)

    monkeypatch.setattr(loader, "_dequantize", dequantize)
    monkeypatch.setenv("SLUICE_MODEL_CACHE", str(tmp_path / "dense"))
    return calls


@pytest.fixture
def src(tmp_path: Path) -> ModelSource:
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(64))
    return ModelSource(str(tmp_path), "m.gguf")


def test_made_once_then_read(made: list[Path], src: ModelSource) -> None:
    first = dense_path(src)
    assert dense_path(src) == first and len(made) == 1
    assert AutoConfig.from_pretrained(first).model_type == "llama"
    manifest = json.loads((Path(first) / MANIFEST).read_text())
    assert manifest["key"]["mtime_ns"] == (Path(src.path) / "m.gguf").stat().st_mtime_ns
    assert "model.safetensors" in manifest["files"]
    assert not list(Path(first).parent.glob("*.tmp*"))


def test_a_changed_key_makes_a_new_copy(made: list[Path], src: ModelSource, monkeypatch: pytest.MonkeyPatch) -> None:
    first = dense_path(src)
    gguf = Path(src.path) / "m.gguf"
    st = gguf.stat()
    os.utime(gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the same size, one nanosecond newer
    second = dense_path(src)
    assert second != first and len(made) == 2
    version = loader._version
    monkeypatch.setattr(loader, "_version", lambda p: "0.0-other" if p == "transformers" else version(p))
    third = dense_path(src)
    assert third not in (first, second) and len(made) == 3
    gguf.write_bytes(b"GGUF" + bytes(65))  # another file at the same path
    assert dense_path(src) not in (first, second, third) and len(made) == 4


def _damage_keeping_mtime(path: Path, change: object) -> None:
    st = path.stat()
    change(path)  # type: ignore[operator]
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _zero_header(path: Path) -> None:
    with path.open("r+b") as f:
        f.write(bytes(8))


def _append(path: Path) -> None:
    with path.open("ab") as f:
        f.write(b"x")


@pytest.mark.parametrize("damage", ["truncated", "appended", "header", "manifest torn", "manifest gone",
                                    "file gone", "foreign manifest"])
def test_a_damaged_copy_is_made_again_not_read(damage: str, made: list[Path], src: ModelSource,
                                               caplog: pytest.LogCaptureFixture) -> None:
    out = Path(dense_path(src))
    weights = out / "model.safetensors"
    if damage == "truncated":
        _damage_keeping_mtime(weights, lambda p: os.truncate(p, p.stat().st_size - 1))
    elif damage == "appended":
        _damage_keeping_mtime(weights, _append)
    elif damage == "header":  # same size, same mtime: only the header check sees it
        _damage_keeping_mtime(weights, _zero_header)
    elif damage == "manifest torn":
        (out / MANIFEST).write_text('{"key": ')
    elif damage == "manifest gone":  # a directory an older version left, or a copy interrupted before its manifest
        (out / MANIFEST).unlink()
    elif damage == "file gone":
        weights.unlink()
    else:
        manifest = json.loads((out / MANIFEST).read_text())
        (out / MANIFEST).write_text(json.dumps({**manifest, "key": {**manifest["key"], "torch": "0.0"}}))
    with caplog.at_level(logging.WARNING, logger="sluice.engine.loader"):
        again = Path(dense_path(src))
    assert again == out and len(made) == 2, damage
    assert "not using the dense copy" in caplog.text
    assert loader._dense_problem(out, json.loads((out / MANIFEST).read_text())["key"]) is None
    assert AutoConfig.from_pretrained(out).model_type == "llama"
    assert not [p for p in out.parent.iterdir() if p != out]  # no tmp or bad copy left beside it
