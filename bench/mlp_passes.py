"""The engine's MLP (engine/models/llama.py, oneDNN GEMMs, the C++ SiLU) over one long step's rows, in one pass
and in passes of ``--rows`` rows (kernels/cpu_fused.py's MLP_BLOCK_BYTES decides the engine's), alternating::

    python bench/mlp_passes.py --threads 1 --rows 0,2048,1024,512   # 0: one pass

With one thread it reads the thread's CPU time, which another process's load hardly moves (it does move
wall time); with more, wall time (quiet machine only). SmolLM2-135M's shapes by default.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after site-packages: our kernels/ must not hide transformers' kernels

import torch  # noqa: E402
from sluice.engine.linear import make_linear  # noqa: E402
from sluice.engine.models import llama  # noqa: E402
from sluice.kernels import cpu_fused  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="rows of the step (the token budget)")
    ap.add_argument("--rows", default="0,2048,1024,512", help="rows per pass, comma-separated; 0 = one pass")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--impl", default="onednn-packed", help="the GEMM path (engine/linear.py)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    mlp = llama.MLP(args.hidden, args.inter, bias=False)
    mlp.gate_up_proj = make_linear(args.impl, mlp.gate_up_proj)
    mlp.down_proj = make_linear(args.impl, mlp.down_proj)
    mlp.kernels = cpu_fused
    llama.MLP_MIN_ROWS = 1
    x = torch.randn(args.tokens, args.hidden)
    row_bytes = 2 * args.inter * x.element_size()
    sizes = [int(r) for r in args.rows.split(",")]
    times: dict[int, list[float]] = {r: [] for r in sizes}
    outs = {}
    with torch.inference_mode():
        for _ in range(args.rounds + 1):  # the first round warms oneDNN's kernels up and is not counted
            for r in sizes:
                cpu_fused.MLP_BLOCK_BYTES = (r or args.tokens) * row_bytes
                t = clock()
                outs[r] = mlp(x)
                times[r].append(clock() - t)
    flops = 2 * args.tokens * 3 * args.hidden * args.inter
    print(f"MLP over {args.tokens} rows ({args.hidden} -> 2 x {args.inter} -> {args.hidden}, {args.impl}, "
          f"{args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} time, best of {args.rounds})")
    for r in sizes:
        best = min(times[r][1:])
        same = torch.equal(outs[r], outs[sizes[0]])
        print(f"  {'one pass' if r == 0 else f'passes of {r}':>16}: {best * 1e3:7.1f} ms  {flops / best / 1e9:6.1f} GFLOP/s"
              f"  same bits as {sizes[0] or 'one pass'}: {same}")


if __name__ == "__main__":
    main()
