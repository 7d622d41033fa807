"""Every kernel launch the wrappers make compiles ahead of time for the H200 (sm_90), down to a cubin.

This machine has no GPU: ``sluice.kernels.aot`` records the wrappers' launches on CPU tensors and hands
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

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {
    "_store_kvcache_kernel",
    "_decode_split_kernel",
    "_decode_merge_kernel",
    "_prefill_kernel",
    "_rms_norm_kernel",
    "_rotary_kernel",
    "_silu_and_mul_kernel",
}


# About 170 kernels (every variant the engine launches, in three dtypes): minutes on 2 busy cores.
pytestmark = pytest.mark.timeout(1500)
DTYPES = ("fp32", "fp16", "bf16")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One compiler process per dtype, side by side: compiling is single-threaded, and this process only
    waits (one process for all three took 5 minutes of the suite)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    logs = tmp_path_factory.mktemp("aot-logs")
    procs = []
    for dtype in DTYPES:
        # A fresh cache, so that each kernel is really compiled rather than found from an earlier run.
        env_d = {**env, "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp(f"triton-cache-{dtype}"))}
        with open(logs / f"{dtype}.out", "w") as out, open(logs / f"{dtype}.err", "w") as err:  # files: no pipe fills
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sluice.kernels.aot", "--arch", "90", "--stage", "cubin", "--json",
                 "--dtypes", dtype], cwd=ROOT, env=env_d, stdout=out, stderr=err))
    results = []
    try:
        for dtype, proc in zip(DTYPES, procs, strict=True):
            assert proc.wait(timeout=1400) == 0, (logs / f"{dtype}.err").read_text()[-5000:]
            out = (logs / f"{dtype}.out").read_text()
            results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        for proc in procs:
            proc.kill()
    return results


def test_every_kernel_and_dtype_compiles_to_cubin(compiled: list[dict]) -> None:
    assert {r["kernel"] for r in compiled} == KERNELS
    for dtype in DTYPES:
        kernels = {r["kernel"] for r in compiled if r["case"].startswith(dtype + "/")}
        assert kernels == KERNELS, dtype
    assert all(r["stage"] == "cubin" for r in compiled)


def test_wrapper_variants_are_covered(compiled: list[dict]) -> None:
    """Every variant the engine can launch: both decode paths (direct and split + merge), each with and
    without sliding window + soft-cap, as prefill; GQA groups 1, 2, 3, 4 and 8 at head dims 64, 128 and 256."""
    for dtype in DTYPES:
        split = [r["constexprs"] for r in compiled if r["kernel"] == "_decode_split_kernel"
                 and r["case"].startswith(dtype + "/")]
        assert {(c["DIRECT"], c["SLIDING"], c["SOFT_CAP"]) for c in split} == {
            (direct, on, on) for direct in (True, False) for on in (True, False)}, dtype
        assert {c["HEAD_DIM"] for c in split} == {64, 128, 256}
        prefill = [r["constexprs"] for r in compiled if r["kernel"] == "_prefill_kernel"
                   and r["case"].startswith(dtype + "/")]
        assert {c["GROUP"] for c in prefill} == {1, 2, 3, 4, 8}
        assert {c["HEAD_DIM"] for c in prefill} == {64, 128, 256}
        assert {(c["SLIDING"], c["SOFT_CAP"]) for c in prefill} == {(True, True), (False, False)}


def test_no_register_spills(compiled: list[dict]) -> None:
    """A spill to local memory (LOCAL) would cost the kernels their bandwidth on the GPU; in the half
    dtypes the engine runs there, no stack frame (local memory too) either. float32, which only tests run
    on a GPU, has kilobytes of stack in the attention kernels (ieee dots on [64, d] tiles): known, allowed.
    Shared memory must fit an H100/H200 block's 227 KiB."""
    for r in compiled:
        assert "LOCAL:0" in r["usage"], r
        if not r["case"].startswith("fp32/"):
            assert "STACK:0" in r["usage"], r
        assert r["shared"] <= 227 * 1024, r
