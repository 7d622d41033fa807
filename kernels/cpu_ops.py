"""Build (once, cached) and load the C++ CPU ops in ``kernels/cpu/``: paged attention, an encoder's variable-length
attention, the KV-cache write, the decoder layer's fused elementwise ops, greedy argmax and sampling's passes
over the vocabulary (wrapped in ``kernels/cpu_fused.py``), and a layer's LoRA deltas for every adapter's rows.

The op is compiled on first use with ``torch.utils.cpp_extension`` for the CPU it runs on
(``-march=native``); the build's name carries a hash of the source, the compiler flags and the CPU's
feature flags, so a cache directory shared between unlike machines never hands one a binary built for
another, and of where the source and torch are, so two checkouts or virtual environments sharing the
cache do not rebuild each other's (their build commands differ in those paths). ``scripts/install.sh``
builds it at install time so a worker's first step does not wait for g++. A build that loaded is noted
(its library's path and SHA-256, in SLUICE_HOME/cache/ops or the user's cache, e.g. ~/.cache/sluice/ops),
and a later process loads that library directly while it matches, without torch's build check.

A build holds torch's ``lock`` file in its directory, and a process killed -9 mid-build leaves it behind:
torch would wait on it forever, in every later process. So a build also holds an ``flock`` (the kernel
drops it when the holder dies) and whoever holds that removes a ``lock`` no live builder owns.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import platformdirs
import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "cpu" / name for name in ("paged_attention.cpp", "paged_attention_gemm.cpp",
                                                           "store_kv.cpp", "fused.cpp", "argmax.cpp", "sampling.cpp",
                                                           "encoder_attention.cpp", "lora.cpp")]
# Included by the sources; hashed with them.
HEADERS = [Path(__file__).parent / "cpu" / name for name in ("common.h", "paged_plan.h")]
# -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers; without it the op runs on one thread
# (the symbols resolve to the libgomp torch has loaded, so there is one thread pool).
# -ffp-contract=off: a multiply and an add stay two roundings, as in eager PyTorch (fused.cpp's rotary is
# bit-identical to the model's in float32); the kernels ask for fused multiply-adds where they want them.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def build_name() -> str:
    digest = hashlib.sha256()
    for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), " ".join(CFLAGS).encode(), _cpu_flags().encode(),
                 torch.__version__.encode(), str(SOURCES[0].resolve()).encode(),
                 str(Path(torch.__file__).resolve().parent).encode()):
        digest.update(part)
    return f"sluice_cpu_attention_{digest.hexdigest()[:12]}"


def build_dir(name: str) -> Path:
    """Where ``load_extension`` builds ``name`` (TORCH_EXTENSIONS_DIR or the user's cache); created."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@functools.cache
def load() -> Any:
    """``torch.ops.sluice``, with the compiled op registered; raises if it cannot be built (callers fall
    back to PyTorch)."""
    name = build_name()
    if not _load_built(name):
        _build_and_load(name)
    return torch.ops.sluice


def _build_and_load(name: str) -> None:
    from torch.utils.cpp_extension import load as load_extension

    where = build_dir(name)
    log.info("loading the C++ CPU attention op %s (built on first use, then cached)", name)
    with open(where / "sluice.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits for a live builder; a dead one's is gone
        stale = where / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed", stale)
            stale.unlink()
        with own_ninja():
            library = load_extension(name=name, sources=[str(src) for src in SOURCES], extra_cflags=CFLAGS,
                                     is_python_module=False, verbose=False)
    _note_built(name, Path(library))


@contextlib.contextmanager
def own_ninja() -> Iterator[None]:
    """The ``ninja`` package's binary first on PATH while torch builds: torch runs whichever ``ninja`` PATH
    finds, and two versions (Debian's 1.11, the wheel's 1.13) log a build's commands under different hashes,
    so each takes the other's build for stale and rebuilds all of it: 5 minutes on 2 cores, each time a
    process with the virtual environment's bin/ on PATH (the CLI) and one without (``.venv/bin/python``)
    took turns."""
    try:
        import ninja
    except ImportError:  # a dependency; without it torch's own search stands
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(filter(None, [ninja.BIN_DIR, before]))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


# A build found once is loaded directly next time: importing torch.utils.cpp_extension (setuptools) and
# running ninja to find nothing to do took most of a second of start-up. The note names the library and
# its SHA-256; the library is loaded only if it still matches, else the build above runs (and re-notes).
def _note_path(name: str) -> Path:
    home = os.environ.get("SLUICE_HOME")  # the rule of engine/tuning_cache.py's directory()
    base = Path(home) / "cache" if home else Path(platformdirs.user_cache_dir("sluice", appauthor=False))
    return base / "ops" / f"{name}.json"


def _note(name: str, library: Path) -> dict[str, Any]:
    data = library.read_bytes()
    return {"name": name, "library": str(library), "size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
            "extensions_dir": os.environ.get("TORCH_EXTENSIONS_DIR", "")}


def _load_built(name: str) -> bool:
    """Load the library noted for ``name`` if it is there unchanged; False: build (or check) it instead."""
    try:
        note = json.loads(_note_path(name).read_text())
        library = Path(note["library"])
        fresh = note == _note(name, library)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if not fresh:
        log.info("the C++ CPU op %s changed since it was noted: checking its build", library)
        return False
    torch.ops.load_library(str(library))
    log.info("loaded the C++ CPU op %s", library)
    return True


def _note_built(name: str, library: Path) -> None:
    path = _note_path(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as f:
            json.dump(_note(name, library), f)
        os.replace(f.name, path)
    except OSError as e:  # a read-only cache: the next process checks the build again, no harm
        log.info("not noting the C++ CPU op's build in %s: %s", path.parent, e)


def available() -> tuple[bool, str]:
    """Whether the op builds and loads here, and why not."""
    try:
        load()
    except Exception as e:  # a missing compiler, headers or a failed build all mean: use the fallback
        return False, f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    return True, ""


def attention_kernel(dtype: torch.dtype, head_dim: int) -> str:
    """Which kernel ``paged_attention`` runs: ``gemm`` (kernels/cpu/paged_attention_gemm.cpp: oneDNN's
    batch-reduce GEMM, on AMX where the CPU has it) for float32 and bfloat16 where oneDNN's micro-kernel
    takes them, else ``vector`` (kernels/cpu/paged_attention.cpp: AVX-512 or generic loops)."""
    return "gemm" if head_dim % 2 == 0 and bool(load().gemm_attention_supports(dtype)) else "vector"


def attention_isa(dtype: torch.dtype, head_dim: int) -> str:
    """The instructions the attention kernel runs on, for benchmarks' reports: ``amx`` (bfloat16 GEMMs on
    AMX tiles), else torch's vector capability (``avx512``, ``avx2``, ...)."""
    if attention_kernel(dtype, head_dim) == "gemm" and dtype == torch.bfloat16 and bool(load().cpu_has_amx()):
        return "amx"
    return torch.backends.cpu.get_cpu_capability().lower()


def paged_attention(out: torch.Tensor, q: torch.Tensor, k_cache_hm: torch.Tensor, v_cache_hm: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    kernel: str | None = None) -> torch.Tensor:
    """Causal attention of packed queries ``q`` [T, Hq, D] over head-major caches [Hkv, blocks, block, D],
    written into ``out``; query ``j`` of sequence ``b`` sits at ``seq_lens[b] - q_len[b] + j``. ``kernel``:
    ``gemm`` or ``vector`` (tests and benchmarks); by default ``attention_kernel``'s choice."""
    ops = load()
    args = (out, q, k_cache_hm, v_cache_hm, block_tables, query_start_loc, seq_lens, scale, sliding_window or 0,
            logits_soft_cap or 0.0)
    if (kernel or attention_kernel(q.dtype, q.shape[-1])) == "vector":
        ops.paged_attention(*args)
    else:  # kernel="gemm" sends every tile to the matrix units, decodes too
        ops.paged_attention_gemm(*args, 0 if kernel == "gemm" else MIN_GEMM_ROWS)
    return out


# Tiles of fewer GEMM rows (query rows x the query heads sharing a KV head) than this take the vector kernel:
# a decode's 3 rows (SmolLM2) ran 1.5x slower on the GEMM kernel than on the vector one (AMD EPYC, AVX512-BF16,
# no AMX; bench/attention_micro.py), its key block packed for a single use. 16 rows fill one AMX tile.
MIN_GEMM_ROWS = 16


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache_hm: torch.Tensor, v_cache_hm: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V ``[T, Hkv, D]`` into head-major caches at ``slot_mapping`` (int64; -1 = skip)."""
    load().store_kv(k, v, k_cache_hm, v_cache_hm, slot_mapping)


def load_variant(source: Path, namespace: str, cflags: list[str] | None = None, op: str = "paged_attention") -> Any:
    """``op`` built from another ``source`` (an older version, or this one with other ``cflags``, e.g.
    without AVX-512) and registered as ``torch.ops.<namespace>``, beside the real op."""
    from torch.utils.cpp_extension import load as load_extension

    text = source.read_text()
    for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT", "TORCH_LIBRARY_IMPL"):
        text = text.replace(f"{macro}(sluice,", f"{macro}({namespace},")
    flags = CFLAGS if cflags is None else cflags
    header = "".join(h.read_text() for h in HEADERS)
    tag = hashlib.sha256((text + header + " ".join(flags) + torch.__version__).encode()).hexdigest()[:10]
    copy = build_dir(f"{namespace}_{tag}") / f"{namespace}.cpp"
    if not copy.exists() or copy.read_text() != text:  # a rewrite would make ninja rebuild it every time
        copy.write_text(text)
    with own_ninja():
        load_extension(name=f"{namespace}_{tag}", sources=[str(copy)], extra_cflags=flags, is_python_module=False,
                       extra_include_paths=[str(HEADERS[0].parent)])  # the copy lives elsewhere; common.h stays here
    return getattr(getattr(torch.ops, namespace), op)


def encoder_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Non-causal attention of float32 ``q``/``k``/``v`` [B, S, H, D] (any strides, last one 1), batch row
    ``b`` over its first ``lengths[b]`` (int64) tokens only, into ``out`` [B, S, H, D]; rows past a length
    are zeros."""
    load().encoder_attention(out, q, k, v, lengths, scale)
    return out


def encoder_attention_supports(head_dim: int) -> bool:
    """Whether this build has ``encoder_attention`` for ``head_dim`` (it needs AVX-512)."""
    return bool(load().encoder_attention_supports(head_dim))


def lora_add_(out: torch.Tensor, x: torch.Tensor, runs: torch.Tensor, a: torch.Tensor, b: list[torch.Tensor],
              cols: list[int], c0s: list[int]) -> None:
    """Add each run's LoRA deltas to ``out`` [T, N] in place (kernels/cpu/lora.cpp): ``runs`` int64 [n, 3]
    (first row, end row, slot), ``a`` float32 [G, K, R] (every target's scaled A^T side by side), per target
    ``b`` float32 [G, R_t, W_t] (B^T), its first output column and first column of the shrink."""
    load().lora_add_(out, x, runs, a, b, cols, c0s)
