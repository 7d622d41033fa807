"""Section 2b: the fused elementwise kernels against their eager PyTorch forms."""

from __future__ import annotations

from functools import partial
from typing import Any

from bench.gpu_checks.common import TOL, Plan, Reporter, time_ms

# ---- 2b. fused elementwise kernels ---------------------------------------------------------------------


def _eager_add_rms_norm(x: Any, residual: Any, weight: Any, eps: float) -> tuple[Any, Any]:
    """engine/models/llama.py's unfused residual add and RMSNorm."""
    import torch

    h = residual + x
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype), h


def _eager_rotary(positions: Any, q: Any, k: Any, cos: Any, sin: Any) -> tuple[Any, Any]:
    """engine/models/llama.py's unfused rotary embedding."""
    import torch

    c, s = cos[positions].to(q.dtype)[:, None, :], sin[positions].to(q.dtype)[:, None, :]

    def rot(x: Any) -> Any:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rot(q) * s, k * c + rot(k) * s


def check_fused(plan: Plan, rows: Reporter) -> bool:
    """Residual add + RMSNorm and rotary at Llama-3.2-1B's sizes: error against the eager model code
    computed in float32, and time against that eager code (where the fusion pays, if anywhere)."""
    import torch
    from sluice.kernels.fused import apply_rotary, rms_norm
    from sluice.kernels.reference import relative_error

    hidden, hq, hkv, d, dev = 2048, 32, 8, 64, plan.device
    cos, sin = torch.rand(4096, d, device=dev), torch.rand(4096, d, device=dev)
    ok = True
    for dtype_name in plan.dtypes:
        dtype = getattr(torch, dtype_name)
        for tokens in plan.fused_tokens:
            x = torch.randn(tokens, hidden, device=dev).to(dtype)
            res = (4 * torch.randn(tokens, hidden, device=dev)).to(dtype)
            w = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dtype)
            ref, _ = _eager_add_rms_norm(x.float(), res.float(), w.float(), 1e-5)
            norm_err = relative_error(rms_norm(x, w, 1e-5, residual=res)[0], ref.double())
            t_norm = (
                time_ms(partial(rms_norm, x, w, 1e-5, residual=res), dev),
                time_ms(partial(_eager_add_rms_norm, x, res, w, 1e-5), dev),
            )

            pos = torch.randint(0, 4096, (tokens,), device=dev)
            qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=dev).to(dtype)
            q, k = qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
            ref_q, _ = _eager_rotary(pos, q.float(), k.float(), cos.to(dtype).float(), sin.to(dtype).float())
            t_rot = (
                time_ms(partial(apply_rotary, pos, q.clone(), k.clone(), cos, sin), dev),
                time_ms(partial(_eager_rotary, pos, q, k, cos, sin), dev),
            )
            rot_err = relative_error(apply_rotary(pos, q.clone(), k.clone(), cos, sin)[0], ref_q.double())
            for name, err, (ours, eager) in (("add+rms_norm", norm_err, t_norm), ("rotary", rot_err, t_rot)):
                passed = err <= TOL[dtype_name]
                ok &= passed
                rows.append((
                    "fused", f"{name} {dtype_name} T={tokens}", "PASS" if passed else "FAIL",
                    f"max rel err {err:.1e}; {ours * 1e3:.0f} us vs eager torch {eager * 1e3:.0f} us ({eager / ours:.1f}x)",
                ))  # fmt: skip
    return ok
