"""The int8 KV cache's error on a real model's keys and values, and what other schemes would do at (nearly)
the same bytes: attention over K/V captured from the model on real prompts, in float64, exact against each
scheme's dequantized K/V. Cheap (one forward per prompt), no engine: checks that the error is what the
quantization implies and no bug adds to it, and ranks the schemes before any kernel is written.

    python bench/kv_int8_attention_error.py                       # the default model, 4 chat prompts

Schemes (bytes per row for head dim D):
- ``sym``: engine/kv_quant.py's, one float32 absmax scale per row (D + 4).
- ``sym-offset``: keys minus a per-(layer, KV head) channel mean taken from a *different* calibration prompt,
  then ``sym`` (D + 4: the offset is per head, not per row). Exact for attention: every key of a head moves by
  the same vector, so every score of a query moves by the same amount and the softmax is unchanged.
- ``asym``: min/max with a zero point per row (D + 8 as two float32s; D + 4 as two float16s).
- ``sym-k16``/``sym-v16``: only the values (keys) quantized: how much of the error is the keys'.
- ``smooth-*``: keys divided by a per-(layer, KV head) channel scale (equal on each RoPE pair, so it commutes
  with RoPE and folds into k_proj, its inverse into q_proj: no byte and no kernel change), then ``sym``: the
  scale from a calibration prompt's channel absmax (``calib``) or from k_proj's row norms (``weights``), or
  their square roots (half the flattening).

Reported per scheme: the attention output's error over each output row's largest magnitude (mean and worst
over layers, heads and positions), and how often the attention's top key changes. Writes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402  (bench/workloads.py, beside this file)


def sym(x: torch.Tensor) -> torch.Tensor:
    from sluice.engine.kv_quant import dequantize_rows, quantize_rows

    return dequantize_rows(quantize_rows(x), torch.float64)


def asym(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = ((hi - lo) / 255).clamp_min(1e-30)
    return torch.round((x - lo) / scale).clamp(0, 255) * scale + lo


def capture(model: Any, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each layer's (q, k, v) after RoPE, ``[heads, T, D]``, from one forward over ``ids``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def hook(attn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        d = attn.head_dim
        q = attn.q_proj(h).view(*h.shape[:-1], -1, d).transpose(1, 2)
        k = attn.k_proj(h).view(*h.shape[:-1], -1, d).transpose(1, 2)
        v = attn.v_proj(h).view(*h.shape[:-1], -1, d).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        found.append((q[0].double(), k[0].double(), v[0].double()))

    handles = [layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return found


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention, GQA: q ``[Hq, T, D]``, k/v ``[Hkv, T, D]``; the output and each query's top key."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    scores = q @ k.transpose(1, 2) / q.shape[-1] ** 0.5
    t = q.shape[1]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v, scores.argmax(-1)


def row_error(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Each output row's largest error over its largest magnitude."""
    return (out - ref).abs().amax(-1) / ref.abs().amax(-1).clamp_min(1e-30)


def pair_scale(channel: torch.Tensor) -> torch.Tensor:
    """A per-channel key scale ``[Hkv, 1, D]`` equal on each RoPE pair (i, i + D/2), so that it commutes with
    the rotation and could be folded into k_proj (and its inverse into q_proj) with no kernel change."""
    half = channel.shape[-1] // 2
    pair = torch.maximum(channel[..., :half], channel[..., half:])
    return torch.cat([pair, pair], -1).clamp_min(1e-6)


def schemes(k: torch.Tensor, v: torch.Tensor, offset: torch.Tensor, smooth: torch.Tensor,
            smooth_w: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {"sym": (sym(k), sym(v)), "sym-offset": (sym(k - offset) + offset, sym(v)),
            "asym": (asym(k), asym(v)), "sym-k16": (k, sym(v)), "sym-v16": (sym(k), v),
            "smooth-calib": (sym(k / smooth) * smooth, sym(v)),
            "smooth-calib-sqrt": (sym(k / smooth.sqrt()) * smooth.sqrt(), sym(v)),
            "smooth-weights": (sym(k / smooth_w) * smooth_w, sym(v)),
            "smooth-weights-sqrt": (sym(k / smooth_w.sqrt()) * smooth_w.sqrt(), sym(v))}


def weight_scales(model: Any) -> list[torch.Tensor]:
    """From the weights alone: each key channel's k_proj row norm (the input is RMS-normed), per RoPE pair."""
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        w = attn.k_proj.weight.double() * layer.input_layernorm.weight.double()
        out.append(pair_scale(w.norm(dim=1).view(-1, 1, attn.head_dim)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=4)
    args = p.parse_args(argv)
    from sluice.engine.loader import load_hf_model, load_tokenizer

    tok = load_tokenizer(args.model)
    model = load_hf_model(args.model, torch.float32).eval()
    prompts = workloads.chat_ids(tok, workloads.read_rows(), args.num_prompts + 1)
    calib = capture(model, prompts[-1])  # another prompt's keys
    calibration = [k.mean(1, keepdim=True) for _, k, _ in calib]
    smooth = [pair_scale(k.abs().amax(1, keepdim=True)) for _, k, _ in calib]
    smooth_w = weight_scales(model)
    totals: dict[str, list[torch.Tensor]] = {}
    flips: dict[str, list[torch.Tensor]] = {}
    kv_step: list[torch.Tensor] = []
    for ids in prompts[:-1]:
        layers = zip(capture(model, ids), calibration, smooth, smooth_w, strict=True)
        for (q, k, v), offset, sm, sw in layers:
            ref, top = attend(q, k, v)
            kv_step.append((sym(k) - k).abs().amax(-1).flatten() / k.abs().amax(-1).flatten())
            for name, (kq, vq) in schemes(k, v, offset, sm, sw).items():
                out, top_q = attend(q, kq, vq)
                totals.setdefault(name, []).append(row_error(out, ref).flatten())
                flips.setdefault(name, []).append((top_q != top).flatten().double())
    step = torch.cat(kv_step)
    print(f"keys, sym: largest row error / row max = {step.max():.5f} (1/254 = {1 / 254:.5f})")
    print("| scheme | output error / row max, mean | p99 | worst | top key changed |")
    print("| --- | --- | --- | --- | --- |")
    for name, errs in totals.items():
        e = torch.cat(errs)
        print(f"| {name} | {e.mean():.5f} | {e.quantile(0.99):.5f} | {e.max():.5f} | "
              f"{torch.cat(flips[name]).mean():.2%} |")


if __name__ == "__main__":
    main()
