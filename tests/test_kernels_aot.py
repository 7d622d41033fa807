"""Every kernel launch the wrappers make compiles ahead of time for the H200 (sm_90), down to a cubin.

This machine has no GPU: ``kernels.aot`` records the wrappers' launches on CPU tensors and hands
them to ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``; ptxas ships inside the
triton wheel, so the last stage, the cubin, is reached too. It runs in a subprocess because this
process has TRITON_INTERPRET=1, under which ``@triton.jit`` builds interpreter functions instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNELS = {
    "_store_kvcache_kernel",
    "_decode_split_kernel",
    "_decode_merge_kernel",
    "_prefill_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_silu_and_mul_kernel",
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # A fresh cache, so that each kernel is really compiled rather than found from an earlier run.
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.aot", "--arch", "90", "--stage", "cubin", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_kernel_and_dtype_compiles_to_cubin(compiled: list[dict]) -> None:
    assert {r["kernel"] for r in compiled} == KERNELS
    for dtype in ("fp32", "fp16", "bf16"):
        kernels = {r["kernel"] for r in compiled if r["case"].startswith(dtype + "/")}
        assert kernels == KERNELS, dtype
    assert all(r["stage"] == "cubin" for r in compiled)


def test_wrapper_variants_are_covered(compiled: list[dict]) -> None:
    """Both decode paths (direct and split + merge), and GQA groups 1, 3, 4 and 8 at head dims 64 and 128."""
    split = [r["constexprs"] for r in compiled if r["kernel"] == "_decode_split_kernel"]
    assert {c["DIRECT"] for c in split} == {True, False}
    prefill = [r["constexprs"] for r in compiled if r["kernel"] == "_prefill_kernel"]
    assert {c["GROUP"] for c in prefill} == {1, 3, 4, 8}
    assert {c["HEAD_DIM"] for c in prefill} == {64, 128}


def test_no_register_spills(compiled: list[dict]) -> None:
    """A spill to local memory would cost the decode kernel its bandwidth on the GPU."""
    for r in compiled:
        assert "LOCAL:0" in r["usage"], r
