"""Compile every kernel launch the wrappers make, ahead of time, for a GPU this machine need not have.

The wrappers are called with CPU tensors while ``JITFunction.run`` is replaced by a recorder, so
what gets compiled is exactly what a launch on the GPU would compile: triton's own binder works out
the signature, the specialisations (strides of 1, 16-byte alignment) and the constexprs from the
real arguments. Run it without ``TRITON_INTERPRET`` set (``@triton.jit`` picks the interpreter at
import time)::

    python -m sluice.kernels.aot --arch 90            # every case, cubin via the bundled ptxas
    python -m sluice.kernels.aot --arch 90 --stage ptx
    python -m sluice.kernels.aot --with-triton 3.6.0  # the same under another triton (the GPU image's), installed
                                               # once into /tmp/triton-3.6.0 and put ahead of this one

Each line reports the kernel's registers, stack and spills (LOCAL) and its shared memory, per variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STAGES = ("ttir", "ttgir", "llir", "ptx", "cubin")


@dataclass
class Launch:
    kernel: Any  # a triton JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class Result:
    case: str
    kernel: str
    constexprs: dict[str, Any]
    stage: str  # the last stage produced
    seconds: float
    shared: int | None  # bytes of shared memory
    usage: str  # registers and spills (LOCAL > 0 means spilling), from cuobjdump; "" before cubin


@contextmanager
def recording_launches() -> Iterator[list[Launch]]:
    """Within the block, kernel launches are recorded instead of run."""
    from triton.runtime.jit import JITFunction

    launches: list[Launch] = []
    original = JITFunction.run

    def record(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self, args, kwargs))

    JITFunction.run = record  # type: ignore[method-assign]
    try:
        yield launches
    finally:
        JITFunction.run = original  # type: ignore[method-assign]


def _rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _cases(dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, call) for each configuration whose constexprs differ; the calls only record launches."""
    from sluice.kernels.kv_write import store_kvcache
    from sluice.kernels.paged_attention import paged_decode_attention, paged_prefill_attention

    # (query heads, KV heads, head_dim, block_size): GQA groups 1/2/3/4/8, head dims 64/128 and Gemma's 256.
    shapes = [(4, 4, 64, 16), (9, 3, 64, 16), (32, 8, 64, 16), (32, 4, 128, 32), (8, 4, 256, 16)]
    lens = torch.tensor([5, 100], dtype=torch.int32)
    block_tables = torch.zeros(2, 8, dtype=torch.int32)
    query_start_loc = torch.tensor([0, 2, 7], dtype=torch.int32)
    # Sliding window with logit soft-cap (Gemma 2/3), each kernel with both, as the transformers path passes them.
    window_cap: dict[str, Any] = {"sliding_window": 64, "logits_soft_cap": 30.0}
    for hq, hkv, d, bs in shapes:
        tag = f"hq{hq}-hkv{hkv}-d{d}-bs{bs}"
        # The engine's cache layout (engine/attention.py allocate_kv): head-major memory viewed as
        # [blocks, block_size, heads, dim], so the strides, and their specialisations, are a launch's.
        kc, vc = (_rand(hkv, 8, bs, d, dtype=dtype).permute(1, 2, 0, 3) for _ in range(2))
        k, v = _rand(3, hkv, d, dtype=dtype), _rand(3, hkv, d, dtype=dtype)
        yield f"kv_write-{tag}", partial(store_kvcache, k, v, kc, vc, torch.tensor([0, -1, 7]))
        q = _rand(2, hq, d, dtype=dtype)
        for splits in (1, 4):  # 1: the direct path (no merge), as large batches take it
            yield (
                f"decode-s{splits}-{tag}",
                partial(paged_decode_attention, q, kc, vc, block_tables, lens, 0.125, splits),
            )
            yield (
                f"decode-s{splits}-window-softcap-{tag}",
                partial(paged_decode_attention, q, kc, vc, block_tables, lens, 0.125, splits, **window_cap),
            )
        qp = _rand(7, hq, d, dtype=dtype)
        call = partial(paged_prefill_attention, qp, kc, vc, block_tables, query_start_loc, lens, 5, 0.125)
        yield f"prefill-{tag}", call
        yield f"prefill-window-softcap-{tag}", partial(call, **window_cap)
    yield from _fused_cases(dtype)


def _fused_cases(dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], Any]]]:
    from sluice.kernels.fused import apply_rotary, rms_norm, silu_and_mul

    for hidden in (576, 2048):  # SmolLM2-135M, Llama-3.2-1B
        x, w = _rand(4, hidden, dtype=dtype), _rand(hidden, dtype=dtype)
        yield f"rms_norm-h{hidden}", partial(rms_norm, x, w, 1e-5)
        yield f"add_rms_norm-h{hidden}", partial(rms_norm, x, w, 1e-5, _rand(4, hidden, dtype=dtype))
    for hq, hkv, d in ((9, 3, 64), (32, 8, 64), (32, 8, 128), (8, 4, 256)):
        qkv = _rand(4, (hq + 2 * hkv) * d, dtype=dtype)
        q, k = qkv[:, : hq * d].view(4, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(4, hkv, d)
        cos, sin = torch.rand(64, d), torch.rand(64, d)
        yield f"rotary-hq{hq}-hkv{hkv}-d{d}", partial(apply_rotary, torch.arange(4), q, k, cos, sin)
    for intermediate in (1536, 8192):  # SmolLM2-135M, Llama-3.2-1B
        yield f"silu_and_mul-i{intermediate}", partial(silu_and_mul, _rand(4, 2 * intermediate, dtype=dtype))


def compile_launch(launch: Launch, arch: int, stage: str) -> tuple[Any, dict[str, Any]]:
    """Compile one recorded launch for ``cuda:arch`` as triton's JIT would, up to ``stage``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch.kwargs, bound, specialization, options
    )
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = options.__dict__
    if stage != "cubin":
        # Stop early by compiling to an IR file target: triton.compile runs every stage, so drop the later ones.
        return _compile_until(src, target, opts, stage), _named(fn, constexprs)
    return triton.compile(src, target=target, options=opts), _named(fn, constexprs)


def _compile_until(src: Any, target: Any, opts: dict[str, Any], stage: str) -> Any:
    """``triton.compile`` with the backend's stages after ``stage`` removed (for hosts without ptxas)."""
    import triton
    from triton.backends.nvidia.compiler import CUDABackend

    original = CUDABackend.add_stages

    def add_stages(self: Any, stages: dict[str, Any], options: Any, language: Any) -> None:
        original(self, stages, options, language)
        for name in list(stages)[list(stages).index(stage) + 1 :]:
            del stages[name]

    CUDABackend.add_stages = add_stages  # type: ignore[method-assign]
    try:
        return triton.compile(src, target=target, options=opts)
    finally:
        CUDABackend.add_stages = original  # type: ignore[method-assign]


def _named(fn: Any, constexprs: dict[tuple[int, ...], Any]) -> dict[str, Any]:
    return {fn.arg_names[path[0]]: value for path, value in constexprs.items()}


def run(arch: int, stage: str, dtypes: list[str], only: str | None = None) -> list[Result]:
    results = []
    for dname in dtypes:
        for case, call in _cases(DTYPES[dname]):
            if only and only not in case:
                continue
            with recording_launches() as launches:
                call()
            assert launches, f"{case} launched nothing"
            for launch in launches:
                t0 = time.perf_counter()
                compiled, constexprs = compile_launch(launch, arch, stage)
                md = compiled.metadata
                results.append(
                    Result(
                        case=f"{dname}/{case}",
                        kernel=launch.kernel.__name__,
                        constexprs=constexprs,
                        stage=_last_stage(compiled.asm),
                        seconds=time.perf_counter() - t0,
                        shared=getattr(md, "shared", None),
                        usage=resource_usage(compiled.asm["cubin"]) if "cubin" in compiled.asm else "",
                    )
                )
    return results


def resource_usage(cubin: bytes) -> str:
    """``REG:n STACK:n ... LOCAL:n`` of the cubin's kernel, read with the cuobjdump triton bundles."""
    import triton.backends.nvidia

    tool = os.path.join(triton.backends.nvidia.__path__[0], "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next((x for x in out.splitlines() if "REG:" in x), "")
    return " ".join(x for x in line.split() if x.split(":")[0] in ("REG", "STACK", "LOCAL"))


def rerun_with_triton(version: str, argv: list[str]) -> int:
    """Run this module again with triton ``version`` ahead of the installed one on the path (torch and the
    rest stay this environment's; only the compiler differs). The install goes to /tmp, never the repo."""
    target = os.path.join(tempfile.gettempdir(), f"triton-{version}")
    if not os.path.isdir(os.path.join(target, "triton")):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", target,
                        f"triton=={version}"], check=True)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [target, root, os.environ.get("PYTHONPATH")])))
    env.setdefault("TRITON_CACHE_DIR", os.path.join(target, ".cache"))  # not mixed with the other version's cache
    return subprocess.run([sys.executable, "-m", "sluice.kernels.aot", *argv], env=env).returncode


def _last_stage(asm: dict[str, Any]) -> str:
    return [s for s in STAGES if s in asm][-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100/H200")
    parser.add_argument("--stage", choices=STAGES, default="cubin")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--only", help="compile only the cases whose name contains this")
    parser.add_argument("--json", action="store_true", help="one JSON object per kernel instead of a table")
    parser.add_argument("--with-triton", metavar="VERSION",
                        help="compile under this triton (e.g. 3.6.0, the GPU image's): installed once with pip into "
                             "/tmp/triton-VERSION, outside the repo, and put ahead of this environment's")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile", file=sys.stderr)
        return 2
    if args.with_triton:
        return rerun_with_triton(args.with_triton, [a for a in (argv if argv is not None else sys.argv[1:])
                                                    if not a.startswith("--with-triton") and a != args.with_triton])
    import triton

    print(f"triton {triton.__version__}, torch {torch.__version__}", file=sys.stderr)
    results = run(args.arch, args.stage, args.dtypes.split(","), args.only)
    for r in results:
        if args.json:
            print(json.dumps(dataclasses.asdict(r), default=str))
            continue
        print(
            f"OK {r.case:40s} {r.kernel:24s} stage={r.stage:5s} {r.seconds:5.1f}s "
            f"{r.usage} shared={r.shared} {r.constexprs}"
        )
    print(f"compiled {len(results)} kernels for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
