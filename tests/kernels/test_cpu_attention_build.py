"""The C++ CPU attention op's build cache under faults: a build killed -9 leaves torch's ``lock`` file in
the build directory, on which every later load would wait forever (the chaos test's restarted workers
did, and so did every worker after it on the machine); and each checkout or virtual environment has
its own build, so two of them sharing the cache do not keep rebuilding it for each other."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sluice.kernels.cpu_ops import SOURCES, available, build_dir, build_name

ROOT = Path(__file__).resolve().parents[2]
LOAD = "from sluice.kernels.cpu_ops import load; load(); print('loaded')"


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    ok, why = available()  # built (at install) and loaded here: its build directory is up to date
    if not ok:
        pytest.skip(f"the C++ op does not build here: {why}")
    name = build_name()
    built = build_dir(name)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    copy = build_dir(name)
    assert copy != built
    shutil.copytree(built, copy, dirs_exist_ok=True)  # mtimes kept: ninja finds nothing to rebuild
    (copy / "lock").unlink(missing_ok=True)
    (copy / "lock").touch()  # what a builder killed -9 leaves: torch's baton, nobody to release it
    p = subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, env=dict(os.environ), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "loaded", p.stderr[-3000:]
    assert "left by a build that was killed" in p.stderr and not (copy / "lock").exists()


def test_each_checkout_has_its_own_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    here = build_name()
    others = [tmp_path / "other-checkout" / "kernels" / "cpu" / src.name for src in SOURCES]
    others[0].parent.mkdir(parents=True)
    for src, other in zip(SOURCES, others, strict=True):
        other.write_bytes(src.read_bytes())  # the same sources elsewhere: a build command with other paths
    monkeypatch.setattr("sluice.kernels.cpu_ops.SOURCES", others)
    assert build_name() != here


FAST = ("import sys; from sluice.kernels.cpu_ops import load; load(); "
        "print('loaded', 'torch.utils.cpp_extension' in sys.modules)")


def _load_in_child(home: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SLUICE_HOME=str(home))
    return subprocess.run([sys.executable, "-c", FAST], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_noted_build_loads_without_the_build_check_and_a_bad_note_is_not_trusted(tmp_path: Path) -> None:
    ok, why = available()
    if not ok:
        pytest.skip(f"the C++ op does not build here: {why}")
    home = tmp_path / "home"
    first = _load_in_child(home)  # no note yet: torch's build check, then the note
    assert first.returncode == 0 and first.stdout.split() == ["loaded", "True"], first.stderr[-3000:]
    note = home / "cache" / "ops" / f"{build_name()}.json"
    good = json.loads(note.read_text())
    assert Path(good["library"]).is_file() and good["size"] == Path(good["library"]).stat().st_size
    second = _load_in_child(home)
    assert second.returncode == 0 and second.stdout.split() == ["loaded", "False"], second.stderr[-3000:]
    # A note that no longer matches its library, or one that does not parse, sends the load back to the build
    # check, which notes the build again.
    for bad in (json.dumps({**good, "sha256": "0" * 64}), json.dumps({**good, "size": good["size"] + 1}),
                '{"name": ', "[]"):
        note.write_text(bad)
        again = _load_in_child(home)
        assert again.returncode == 0 and again.stdout.split() == ["loaded", "True"], (bad, again.stderr[-3000:])
        assert json.loads(note.read_text()) == good


def test_the_build_check_runs_the_environments_own_ninja_whatever_path_finds_first(tmp_path: Path) -> None:
    """Another ``ninja`` first on PATH (Debian's 1.11 beside the wheel's 1.13 on CI) took the install's build
    for stale and rebuilt it, 5 minutes a time; here a stand-in that only records being run."""
    ok, why = available()
    if not ok:
        pytest.skip(f"the C++ op does not build here: {why}")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "ninja").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    (bin_dir / "ninja").chmod(0o755)
    env = dict(os.environ, SLUICE_HOME=str(tmp_path / "home"), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    p = subprocess.run([sys.executable, "-c", FAST], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.split() == ["loaded", "True"], p.stderr[-3000:]  # the build check ran
    assert not calls.exists(), calls.read_text()
