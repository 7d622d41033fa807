"""A prompt step's work outside attention (GEMMs, norms, rotary, SiLU) at several chunk sizes: the same
``--tokens`` rows through ``--layers`` decoder layers, run as chunks of each size (the step's token
budget, ``max_num_batched_tokens``), to see whether big chunks pay for spilling the activations out of
cache. Sizes alternate within each round; the table gives each size's best time and the median over
rounds of its time over the first size's (on a busy machine the ratio says more than either time)::

    python bench/prefill_chunk.py --sizes 4096,2048,1024,512 --tokens 4096 --layers 8

SmolLM2-135M's shapes by default; the GEMMs run as the engine runs them on the CPU (oneDNN, packed
weights, float32) and the elementwise ops are the engine's C++ ones. Attention is left out: its work
does not depend on how a prompt is chunked.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after site-packages: our kernels/ must not hide transformers' kernels

import torch  # noqa: E402
from sluice.engine.linear import make_linear  # noqa: E402
from sluice.kernels.cpu_fused import apply_rotary, rms_norm, silu_and_mul  # noqa: E402
from torch import nn  # noqa: E402


class Layer:
    """One decoder layer's GEMMs and elementwise ops, attention replaced by its output's shape."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, impl: str) -> None:
        def dense(n_in: int, n_out: int) -> nn.Module:
            return make_linear(impl, nn.Linear(n_in, n_out, bias=False))

        self.qkv = dense(hidden, (heads + 2 * kv_heads) * head_dim)
        self.o = dense(heads * head_dim, hidden)
        self.gate_up = dense(hidden, 2 * inter)
        self.down = dense(inter, hidden)
        self.norm1, self.norm2 = torch.ones(hidden), torch.ones(hidden)
        self.shape = (heads, kv_heads, head_dim)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        heads, kv_heads, head_dim = self.shape
        h, residual = rms_norm(x, self.norm1, 1e-5, residual)
        qkv = self.qkv(h)
        q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
        apply_rotary(positions, q, k, cos, sin)
        x = self.o(q.reshape(-1, heads * head_dim))  # stands in for attention's output, same shape
        h, residual = rms_norm(x, self.norm2, 1e-5, residual)
        return self.down(silu_and_mul(self.gate_up(h))), residual


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4096,2048,1024,512", help="chunk sizes (rows per step), comma-separated")
    ap.add_argument("--tokens", type=int, default=4096, help="rows run through the layers at each size")
    ap.add_argument("--layers", type=int, default=8, help="distinct layers (enough that weights leave the cache)")
    ap.add_argument("--impl", default="onednn-packed", help="the GEMM path (engine/linear.py)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--inter", type=int, default=1536)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    sizes = [int(s) for s in args.sizes.split(",")]
    head_dim = args.hidden // args.heads
    with torch.inference_mode():
        layers = [Layer(args.hidden, args.heads, args.kv_heads, head_dim, args.inter, args.impl)
                  for _ in range(args.layers)]
        x0 = torch.randn(args.tokens, args.hidden)
        angles = torch.arange(args.tokens)[:, None] * torch.rand(head_dim)[None, :]
        cos, sin = angles.cos(), angles.sin()
        positions = torch.arange(args.tokens)

        def run(size: int) -> float:
            t = time.perf_counter()
            for start in range(0, args.tokens, size):
                x, res = x0[start : start + size], torch.zeros(min(size, args.tokens - start), args.hidden)
                for layer in layers:
                    x, res = layer(x, res, positions[start : start + size], cos, sin)
            return time.perf_counter() - t

        for size in sizes:  # warm-up: oneDNN picks and caches its kernel per shape
            run(size)
        best = {s: float("inf") for s in sizes}
        ratios: dict[int, list[float]] = {s: [] for s in sizes}
        for _ in range(args.rounds):
            this = {s: run(s) for s in sizes}
            for s in sizes:
                best[s] = min(best[s], this[s])
                ratios[s].append(this[s] / this[sizes[0]])
    flops = 2 * args.tokens * sum(_weights(m).numel() for layer in layers
                                  for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    print(f"{args.tokens} rows x {args.layers} layers ({args.impl}, {torch.get_num_threads()} threads): "
          f"best of {args.rounds}, median time ratio to chunks of {sizes[0]}")
    for s in sizes:
        rs = ratios[s]
        print(f"  chunks of {s:5d}: {best[s] * 1e3:8.1f} ms  {flops / best[s] / 1e9:6.1f} GFLOP/s  "
              f"ratio {statistics.median(rs):.3f} (rounds {min(rs):.3f}-{max(rs):.3f})")


def _weights(module: nn.Module) -> torch.Tensor:
    """The dense weight's shape, also for a packed layer (whose packed tensor is opaque)."""
    if hasattr(module, "in_features"):
        return torch.empty(module.out_features, module.in_features, device="meta")
    return module.weight


if __name__ == "__main__":
    main()
