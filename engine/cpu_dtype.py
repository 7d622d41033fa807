"""``--dtype auto`` on a CPU: float32 or bfloat16, whichever runs this model's decode layer faster here.

CPUs differ: with AMX, bfloat16 matmuls are several times faster than float32; with AVX512-BF16 alone
they measured slower on some machines; without either they are emulated. So it is measured, once per
process: one decoder layer's matmuls at the model's shapes and attention over a paged cache, at a
decode batch, in each dtype, interleaved and best-of-N so a busy machine skews both alike; the choice is
kept across runs (engine/tuning_cache.py, keyed by CPU, torch build, the layer's shapes and the kernels). Each dtype's
matmuls run the way the engine would run them (engine/linear.py picks the fastest GEMM per dtype, e.g.
float32 compute for bfloat16 weights where oneDNN's bfloat16 kernel is slow). bfloat16 must win by a
margin, since float32 is exact. A timing disturbed by other work (a dtype's runs varying by more than
STEADY) decides only this process: it is not kept, so one busy moment cannot fix a wrong choice for every
later run (on a loaded machine one such timing once read 88 ms float32 against 2.7 ms bfloat16).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sluice.engine import linear, tuning_cache

log = logging.getLogger(__name__)

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
MARGIN = 1.15  # bfloat16 must be this much faster to be chosen
BATCH, CONTEXT, REPEATS = 128, 256, 7
STEADY = 1.25  # a dtype's median run over its best run: more means other work disturbed the timing


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def pick_cpu_dtype(config: Any, cpu_linear: str = "auto") -> tuple[torch.dtype, str]:
    """The dtype for this model on this CPU, and the reason (for the log). ``cpu_linear``: the engine's
    setting of that name; each dtype is timed with the GEMMs it would select."""
    flags = cpu_flags()
    if not flags & set(BF16_FLAGS):
        return torch.float32, "this CPU has no bfloat16 instructions (amx_bf16, avx512_bf16)"
    parts = {"layer": _layer_shape(config), "cpu_linear": cpu_linear, "bf16_flags": sorted(flags & set(BF16_FLAGS)),
             "batch": BATCH, "context": CONTEXT, "repeats": REPEATS, "margin": MARGIN, "attention": _attention_build()}
    cached = tuning_cache.get("dtype", parts)
    if cached is not None:
        value, path = cached
        if isinstance(value, list) and len(value) == 2 and value[0] in ("float32", "bfloat16"):
            return getattr(torch, value[0]), f"{value[1]} (measured earlier: {path})"
    dtype, detail, kept = _measure(config, cpu_linear, flags)
    if not kept:
        log.warning("--dtype auto: the timing varied by more than %.0f%% between runs (other work on this "
                    "machine?); %s chosen for this run only, not kept", (STEADY - 1) * 100, dtype)
        return dtype, f"{detail}; timed on a busy machine, so not kept"
    tuning_cache.put("dtype", parts, [str(dtype).removeprefix("torch."), detail])
    return dtype, detail


def steady(times: list[float]) -> bool:
    """Whether repeated runs of one workload agree well enough for their best to be trusted later."""
    return statistics.median(times) <= STEADY * min(times)


def _layer_shape(config: Any) -> list[Any]:
    """What the measurement's result depends on in the model: its layer's GEMMs and attention heads."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return [[list(s) for s in linear.model_gemm_shapes(config).layer], heads, kv_heads, head_dim]


def _attention_build() -> str:
    """The attention op's build name: a hash of its sources, flags and CPU (a faster kernel may tip the
    balance between the dtypes)."""
    from sluice.kernels.cpu_ops import build_name

    try:
        return build_name()
    except OSError:
        return ""


def _measure(config: Any, cpu_linear: str, flags: set[str]) -> tuple[torch.dtype, str, bool]:
    impl = {dt: _linear_impl(config, dt, cpu_linear) for dt in (torch.float32, torch.bfloat16)}
    layer = {dt: _decode_layer(config, dt, impl[dt]) for dt in impl}
    times: dict[torch.dtype, list[float]] = {dt: [] for dt in layer}
    for _ in range(REPEATS):
        for dt, run in layer.items():
            t0 = time.perf_counter()
            run()
            times[dt].append(time.perf_counter() - t0)
    f32, bf16 = min(times[torch.float32]) * 1e3, min(times[torch.bfloat16]) * 1e3
    kept = all(steady(t) for t in times.values())
    has = ", ".join(f for f in BF16_FLAGS if f in flags)
    detail = (f"one decode layer at batch {BATCH} took {f32:.2f} ms in float32 ({impl[torch.float32]} GEMMs), "
              f"{bf16:.2f} ms in bfloat16 ({impl[torch.bfloat16]} GEMMs; {has})")
    if bf16 * MARGIN < f32:
        return torch.bfloat16, detail, kept
    return torch.float32, detail, kept


def _linear_impl(config: Any, dtype: torch.dtype, requested: str) -> str:
    """What engine/linear.py would run this dtype's GEMMs with: a forced choice where this dtype can take
    it (fp32-compute is for 16-bit weights only), else what it would pick."""
    if requested not in linear.candidates(dtype):
        requested = "auto"
    return linear.pick_cpu_linear(requested, config, torch.device("cpu"), dtype)[0]


def _decode_layer(config: Any, dtype: torch.dtype, impl: str) -> Callable[[], None]:
    """A closure running one layer's matmuls (by ``impl``) and attention at a decode step's shapes."""
    # Not every architecture names these (GPT-NeoX has no KV head count): the usual defaults stand in.
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    gen = torch.Generator().manual_seed(0)
    xs, layers = [], []
    for i, o in linear.model_gemm_shapes(config).layer:
        xs.append(torch.randn(BATCH, i, generator=gen).to(dtype))
        layers.append(linear.make_linear(impl, linear.random_dense(i, o, dtype, gen)))
    attend = _attention(dtype, heads, kv_heads, head_dim)

    def run() -> None:
        with torch.inference_mode():
            for x, layer in zip(xs, layers, strict=True):
                layer(x)
        attend()

    run()  # first calls pay for one-off set-up
    return run


def _attention(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> Callable[[], None]:
    from sluice.kernels.cpu_ops import available, paged_attention

    if not available()[0]:
        return lambda: None
    block = 16
    per_seq = CONTEXT // block
    k_cache = torch.randn(kv_heads, BATCH * per_seq, block, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(BATCH * per_seq, dtype=torch.int32).view(BATCH, per_seq)
    q = torch.randn(BATCH, heads, head_dim).to(dtype)
    out = torch.empty_like(q)
    qsl = torch.arange(BATCH + 1, dtype=torch.int32)
    lens = torch.full((BATCH,), CONTEXT, dtype=torch.int32)
    return lambda: paged_attention(out, q, k_cache, v_cache, tables, qsl, lens, head_dim**-0.5)
