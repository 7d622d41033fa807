"""engine/omp_spin.py: an embedding model's OpenMP spin setting, put in the environment before torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sluice.engine.omp_spin import SPINCOUNT, is_embedding_model, short_omp_spin

ROOT = Path(__file__).resolve().parents[2]


def _fresh_python(code: str, **env: str) -> dict:
    """Run ``code`` in a new interpreter (torch not loaded) without the user's OpenMP settings; its last
    stdout line as JSON."""
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_is_embedding_model(tmp_path: Path) -> None:
    assert is_embedding_model("all-MiniLM-L6-v2") and is_embedding_model("ALL-MINILM-L6-V2")
    assert not is_embedding_model(None)
    assert not is_embedding_model(str(tmp_path))  # a directory without modules.json
    (tmp_path / "modules.json").write_text("[]")
    assert is_embedding_model(str(tmp_path))


def test_too_late_once_torch_is_loaded() -> None:
    import torch  # noqa: F401  (pytest's process has it anyway: libgomp has read its settings)

    env: dict[str, str] = {}
    assert short_omp_spin(env) is False and env == {}


def test_set_before_torch_and_the_user_wins() -> None:
    code = ("import json, os, sys; from sluice.engine.omp_spin import short_omp_spin; env = {}; a = short_omp_spin(env); "
            "u = {'OMP_WAIT_POLICY': 'ACTIVE'}; b = short_omp_spin(u); "
            "print(json.dumps({'set': a, 'env': env, 'user_set': b, 'user': u, 'torch': 'torch' in sys.modules}))")
    r = _fresh_python(code)
    assert r == {"set": True, "env": {"GOMP_SPINCOUNT": SPINCOUNT}, "user_set": False,
                 "user": {"OMP_WAIT_POLICY": "ACTIVE"}, "torch": False}


def test_cli_sets_it_for_an_embedding_model_only() -> None:
    code = ("import json, os, sys; from sluice.cli.common import need_engine; assert 'torch' not in sys.modules; "
            "need_engine({model!r}); "
            "print(json.dumps({{'spin': os.environ.get('GOMP_SPINCOUNT'), 'torch': 'torch' in sys.modules}}))")
    assert _fresh_python(code.format(model="all-MiniLM-L6-v2")) == {"spin": SPINCOUNT, "torch": True}
    assert _fresh_python(code.format(model="SmolLM2-135M-Instruct")) == {"spin": None, "torch": True}
    assert _fresh_python(code.format(model="all-MiniLM-L6-v2"), GOMP_SPINCOUNT="42") == {"spin": "42", "torch": True}
