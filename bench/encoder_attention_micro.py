"""The encoder attention op (kernels/cpu/encoder_attention.cpp) against PyTorch's SDPA with a padding mask
(what transformers' "sdpa" runs for an embedding batch), alternating in one process on the same inputs.

    PYTHONPATH=$PWD python bench/encoder_attention_micro.py                 # all-MiniLM-L6-v2 shapes
    PYTHONPATH=$PWD python bench/encoder_attention_micro.py --threads 1 --repeats 50

Each shape is a right-padded batch [B, S, 12 heads, 32] of q/k/v viewed out of one fused projection,
half of its rows ~8% shorter than S (the pooling runner's padding share is at most 10%); SDPA gets
them transposed to [B, H, S, D] with a boolean mask and its output made [B, S, H * D] again, as
transformers does. GFLOP/s count the padded 4 * B * H * S^2 * D for both, so the ratio is the speed-up.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from sluice.kernels.cpu_ops import encoder_attention

SHAPES = [(64, 32), (32, 64), (16, 128), (8, 256)]  # (batch, longest): 2,048 padded tokens each


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
    keep = (torch.arange(q.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep,
                                         scale=scale)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1).contiguous()


def seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as torch starts)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two; the median is reported")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    heads, dim = 12, 32
    print(f"threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    print("| batch x longest | SDPA ms | op ms | SDPA GFLOP/s | op GFLOP/s | speed-up |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for batch, seq in SHAPES:
        a, b = compare(batch, seq, heads, dim, args.repeats, args.rounds)
        flop = 4 * batch * heads * seq * seq * dim
        print(f"| {batch} x {seq} | {a * 1e3:.2f} | {b * 1e3:.2f} | {flop / a / 1e9:.1f} | {flop / b / 1e9:.1f} "
              f"| {a / b:.2f}x |")


def compare(batch: int, seq: int, heads: int, dim: int, repeats: int, rounds: int) -> tuple[float, float]:
    """Median seconds of SDPA and of the op on one padded batch, alternating."""
    q, k, v = torch.randn(batch, seq, 3, heads, dim).unbind(2)
    lengths = torch.full((batch,), seq)
    lengths[: batch // 2] = max(1, int(seq * 0.92))
    out = torch.empty(batch, seq, heads, dim)
    scale = dim**-0.5
    times: dict[str, list[float]] = {"sdpa": [], "op": []}
    for _ in range(rounds):
        times["sdpa"].append(seconds(lambda: sdpa(q, k, v, lengths, scale), repeats))
        times["op"].append(seconds(lambda: encoder_attention(out, q, k, v, lengths, scale), repeats))
    return statistics.median(times["sdpa"]), statistics.median(times["op"])

if __name__ == "__main__":
    main()
