"""How a CPU linear layer runs its GEMM, chosen per model at load by measurement.

- ``aten``: ``F.linear``, as transformers runs it (the fallback, and the only choice off the CPU).
- ``onednn-packed``: the weight reordered once into oneDNN's blocked layout, run by
  ``mkldnn._linear_pointwise`` at any number of rows. (MKL's packed GEMM is not a candidate: it runs
  packed only at the exact row count it was packed for and silently falls back at any other.)
- ``fp32-compute`` (bfloat16 and float16 models): a float32 GEMM on a packed float32 copy of the
  weight's exact values; the input is upcast, the bias added in float32 and the output rounded to the
  model's dtype once. A product of two bfloat16 values is exact in float32 and oneDNN's bfloat16
  kernel accumulates in float32 too, so this is a bfloat16 GEMM with another summation order. Without
  AMX, oneDNN's bfloat16 kernel measured slower than float32 (issue 10); with AMX it is several times
  faster. The copy doubles the weights' bytes.

Which runs fastest depends on the CPU, so each candidate times the model's own GEMMs at a decode batch,
interleaved and best-of-N so a busy machine slows all alike, once per machine, torch build and shape set:
the choice is kept across runs (engine/tuning_cache.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from sluice.engine import tuning_cache
from sluice.engine.config import CPU_LINEAR
from torch import nn

log = logging.getLogger(__name__)

CHOICES = CPU_LINEAR  # "auto", then the implementations
BATCH, REPEATS = 128, 5
MARGIN = 1.03  # another path must beat aten by this much: within noise, keep transformers' own kernel
PROBE_ELEMENTS = 1 << 24  # a bigger weight is timed on a slice of its rows, and the time scaled up

Shape = tuple[int, int]  # (in_features, out_features)


@dataclass(frozen=True)
class GemmShapes:
    """One decoder layer's GEMMs, how many layers, and the head's GEMM."""

    layer: tuple[Shape, ...]
    num_layers: int
    head: Shape

    @property
    def all(self) -> tuple[Shape, ...]:
        return (*self.layer, self.head)

    def step_seconds(self, seconds: dict[Shape, float]) -> float:
        return self.num_layers * sum(seconds[s] for s in self.layer) + seconds[self.head]


def model_gemm_shapes(config: Any) -> GemmShapes:
    """The GEMMs of a decode step, from a transformers config (fused q/k/v and gate/up, as the native path
    runs them). Not every architecture names these (GPT-NeoX has no KV head count): defaults stand in."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, heads = config.hidden_size, config.num_attention_heads
    inter = getattr(config, "intermediate_size", None) or 4 * hidden
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layer = ((hidden, (heads + 2 * kv_heads) * head_dim), (heads * head_dim, hidden), (hidden, 2 * inter), (inter, hidden))
    return GemmShapes(layer, config.num_hidden_layers, (hidden, config.vocab_size))


# ---- the implementations ------------------------------------------------------------------------
class PackedLinear(nn.Module):
    """oneDNN GEMM on a weight reordered once. The packed tensor is opaque: no ``.weight`` afterwards."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Fp32ComputeLinear(nn.Module):
    """A bfloat16/float16 layer computed in float32 on an exact float32 copy of its weight and bias."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        w, b = weight.detach().float(), None if bias is None else bias.detach().float()
        self.gemm: nn.Module = PackedLinear(w, b) if onednn_supports(torch.float32) else _Aten(w, b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x.float()).to(x.dtype)


class _Aten(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def onednn_supports(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def candidates(dtype: torch.dtype) -> list[str]:
    """The implementations that can run a ``dtype`` model on this CPU."""
    out = ["aten"]
    if onednn_supports(dtype):
        out.append("onednn-packed")
    if dtype in (torch.bfloat16, torch.float16):
        out.append("fp32-compute")
    return out


def make_linear(impl: str, linear: nn.Linear) -> nn.Module:
    """``linear`` run by ``impl`` (``aten`` returns it unchanged)."""
    if impl == "aten":
        return linear
    if impl == "onednn-packed":
        return PackedLinear(linear.weight, linear.bias)
    if impl == "fp32-compute":
        return Fp32ComputeLinear(linear.weight, linear.bias)
    raise ValueError(f"cpu_linear must be one of {', '.join(CHOICES)}, not {impl!r}")


def random_dense(in_features: int, out_features: int, dtype: torch.dtype, gen: torch.Generator) -> nn.Linear:
    """A bias-free layer with normal weights from ``gen``: what the probes time."""
    dense = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    with torch.no_grad():
        dense.weight.copy_(torch.randn(out_features, in_features, generator=gen))
    return dense


# ---- choosing -----------------------------------------------------------------------------------
def time_gemms(shapes: Sequence[Shape], impls: Sequence[str], dtype: torch.dtype, batch: int, repeats: int,
               max_elements: int | None = PROBE_ELEMENTS) -> dict[str, dict[Shape, float]]:
    """Best-of-``repeats`` seconds of each implementation on each ``(in, out)`` GEMM at ``batch`` rows,
    interleaved. Weights over ``max_elements`` are timed on a slice of their output rows and scaled,
    so a 100k-vocabulary head does not allocate gigabytes to be timed."""
    gen = torch.Generator().manual_seed(0)
    runs: dict[tuple[str, Shape], Callable[[], object]] = {}
    scale: dict[Shape, float] = {}
    for k, n in shapes:
        rows = n if max_elements is None else max(1, min(n, max_elements // k))
        scale[(k, n)] = n / rows
        x = torch.randn(batch, k, generator=gen).to(dtype)
        ref = random_dense(k, rows, dtype, gen)
        for impl in impls:
            runs[(impl, (k, n))] = functools.partial(make_linear(impl, ref), x)
    best = {key: float("inf") for key in runs}
    with torch.inference_mode():
        for run in runs.values():
            run()  # first calls pay for one-off set-up (kernel selection, buffers)
        for _ in range(repeats):
            for key, run in runs.items():
                t0 = time.perf_counter()
                run()
                best[key] = min(best[key], time.perf_counter() - t0)
    return {impl: {s: best[(impl, s)] * scale[s] for s in shapes} for impl in impls}


@functools.cache
def choose(shapes: GemmShapes, dtype: torch.dtype) -> tuple[str, str]:
    """The fastest implementation for these GEMMs in ``dtype`` on this CPU, and why (for the log).
    Measured once per machine and torch build, then read from engine/tuning_cache.py."""
    impls = candidates(dtype)
    if len(impls) == 1:
        return "aten", f"only aten can run {_name(dtype)} here"
    parts = {"shapes": [list(shapes.layer), shapes.num_layers, list(shapes.head)], "dtype": _name(dtype),
             "candidates": impls, "batch": BATCH, "repeats": REPEATS, "margin": MARGIN}
    cached = tuning_cache.get("gemm", parts)
    if cached is not None:
        value, path = cached
        if isinstance(value, list) and len(value) == 2 and value[0] in impls:  # else stale: measure again
            return value[0], f"{value[1]} (measured earlier: {path})"
    pick, why = _measure(shapes, dtype, impls)
    tuning_cache.put("gemm", parts, [pick, why])
    return pick, why


def _measure(shapes: GemmShapes, dtype: torch.dtype, impls: list[str]) -> tuple[str, str]:
    seconds = time_gemms(shapes.all, impls, dtype, BATCH, REPEATS)
    step = {impl: shapes.step_seconds(seconds[impl]) for impl in impls}
    fastest = min(impls, key=step.__getitem__)
    pick = fastest if step[fastest] * MARGIN < step["aten"] else "aten"
    times = ", ".join(f"{impl} {step[impl] * 1e3:.3f}" for impl in impls)  # three decimals: a 3% margin shows
    return pick, f"a decode step's GEMMs at batch {BATCH} in {_name(dtype)}, ms: {times}"


def pick_cpu_linear(requested: str, config: Any, device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """The implementation for this model (``requested`` is one of ``CHOICES``), and why."""
    if requested not in CHOICES:
        raise ValueError(f"cpu_linear must be one of {', '.join(CHOICES)}, not {requested!r}")
    if device.type != "cpu":
        return "aten", f"{device.type} runs F.linear"
    if requested == "auto":
        return choose(model_gemm_shapes(config), dtype)
    if requested not in candidates(dtype):
        raise ValueError(f"cpu_linear {requested!r} cannot run a {_name(dtype)} model here "
                         f"(possible: {', '.join(candidates(dtype))})")
    return requested, "forced by cpu_linear"


def install(model: nn.Module, impl: str) -> int:
    """Replace every ``nn.Linear`` in ``model`` by ``impl``'s; returns how many. A module reached by two
    names (the transformers wrapper's ``lm_head`` is also ``hf.lm_head``) gets one replacement. A tied
    embedding keeps its own weight: only the head's GEMM gets a packed copy."""
    if impl == "aten":
        return 0
    made: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Subclasses (quantized, LoRA) may read their own weight; a quantized tensor subclass
            # weight (torchao) runs its own kernel.
            if type(child) is nn.Linear and type(child.weight) is nn.Parameter:
                if id(child) not in made:
                    made[id(child)] = make_linear(impl, child)
                setattr(parent, name, made[id(child)])
    return len(made)


def use_cpu_linear(model: nn.Module, requested: str, config: Any, device: torch.device, dtype: torch.dtype) -> str:
    """Pick and install the linear implementation for a loaded model; logs one line with the reason."""
    impl, why = pick_cpu_linear(requested, config, device, dtype)
    count = install(model, impl)
    memory = "; a float32 copy of the weights doubles their bytes" if impl == "fp32-compute" else ""
    log.info("linear layers: %s (%d replaced): %s%s", impl, count, why, memory)
    return impl


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
