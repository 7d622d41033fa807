"""Section 3: the engine on the GPU, in its own process: logits against transformers, greedy and sampled runs."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

from bench.gpu_checks.common import Plan
from bench.gpu_checks.models import emit

# ---- 3. the engine on the GPU --------------------------------------------------------------------------

SMALL = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)  # fmt: skip


def _row(section: str, item: str, ok: bool | None, detail: str, **data: Any) -> None:
    """A row made in a child: the parent adds it to its report (and its JSON lines) as it arrives."""
    result = "INFO" if ok is None else ("PASS" if ok else "FAIL")
    emit("ROWJ", {"row": [section, item, result, detail], "data": data})


def _rel(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| in float64 over the whole tensor."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def engine_prompt_logits(llm: Any, prompts: list[list[int]]) -> tuple[list[Any], list[Any]]:
    """Every position's logits of each prompt, as one engine prefill step computes them (through the
    runner, into the engine's own cache); leaves the sequences computed and returns them for a decode."""
    from sluice.engine.sampling_params import SamplingParams
    from sluice.engine.scheduler import ScheduledBatch
    from sluice.engine.sequence import Sequence

    runner, bs = llm.runner, llm.config.block_size
    batch, blocks = ScheduledBatch(), 0
    for i, p in enumerate(prompts):
        seq = Sequence(-100 - i, f"logits{i}", 0, list(p), len(p), SamplingParams())
        seq.block_table = list(range(blocks, blocks + -(-(len(p) + 1) // bs)))  # room for one decode
        blocks += len(seq.block_table)
        batch.add(seq, len(p))
    runner.zero_fresh_blocks(blocks)
    ids, pos, meta, _, _ = runner.prepare(batch)
    logits = runner.model.compute_logits(runner.model(ids, pos, runner.kv_caches, meta, runner.backend))
    for seq in batch.seqs:
        seq.num_computed_tokens = seq.num_tokens
    cu = [0, *itertools.accumulate(len(p) for p in prompts)]
    return [logits[a:b] for a, b in itertools.pairwise(cu)], batch.seqs


def engine_decode_logits(llm: Any, seqs: list[Any], next_ids: list[int]) -> dict[str, Any]:
    """One decode step's logits three ways: through the decode runner (a captured graph's replay on CUDA),
    the same bucket run eagerly on the same static inputs, and the unpadded eager step."""
    from sluice.engine.graph_runner import bucket_for
    from sluice.engine.scheduler import ScheduledBatch

    runner = llm.runner
    batch = ScheduledBatch()
    for seq, t in zip(seqs, next_ids, strict=True):
        seq.token_ids.append(t)
        batch.add(seq, 1)
    dr = runner.decode_runner
    model = runner.model
    hidden, _ = dr.run(batch)
    out = {"graph": model.compute_logits(hidden).clone(), "captured": bucket_for(len(seqs), dr.buckets) in dr.graphs}
    out["same_bucket_eager"] = model.compute_logits(dr._forward(bucket_for(len(seqs), dr.buckets))[: len(seqs)])
    ids, pos, meta, last, _ = runner.prepare(batch)
    out["eager"] = model.compute_logits(model(ids, pos, runner.kv_caches, meta, runner.backend)[last])
    return out


def check_engine_logits(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    """Engine vs transformers' forward on the same weights, and graphs vs eager, at the logits."""
    import gc

    import torch
    from sluice.engine.llm import LLM
    from transformers import AutoModelForCausalLM

    dev, dtype = plan.device, getattr(torch, plan.model_dtype)
    prompts = [p[: plan.logit_len] for p, _ in work[:3]]
    refs: dict[str, list[Any]] = {}
    for name, dt in (("float32", torch.float32), (plan.model_dtype, dtype)):
        if name in refs:
            continue
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(dev).eval()
        with torch.inference_mode():
            refs[name] = [hf(torch.tensor([p], device=dev)).logits[0].float() for p in prompts]
        del hf
        gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    llm = LLM(model=model_dir, dtype=plan.model_dtype, attention_backend="triton", **plan.engine_check_kwargs)
    with torch.inference_mode():
        ours, seqs = engine_prompt_logits(llm, prompts)
        ref32, hf_same = refs["float32"], refs[plan.model_dtype]
        err = max(_rel(o, r) for o, r in zip(ours, ref32, strict=True))
        hf_err = max(_rel(h, r) for h, r in zip(hf_same, ref32, strict=True))
        # Both sides round to the model's dtype: the engine may be as far from float32 as transformers is,
        # with a margin for a different order of summation; in float32 both are near 0, so a floor.
        tol = max(2.0 * hf_err, 1e-4 if plan.model_dtype == "float32" else 1e-3)
        top1 = sum(int((o.argmax(-1) == r.argmax(-1)).sum()) for o, r in zip(ours, ref32, strict=True))
        positions = sum(len(p) for p in prompts)
        _row("engine", f"prefill logits vs transformers ({plan.model_dtype})", err <= tol,
             f"rel err vs float32 forward {err:.2e}, transformers {plan.model_dtype} {hf_err:.2e} (tol {tol:.1e} = "
             f"2x that, floor); top-1 as float32 at {top1}/{positions} positions, prompts {[len(p) for p in prompts]}",
             error=err, hf_error=hf_err, tol=tol)
        next_ids = [int(o[-1].argmax()) for o in ours]
        dec = engine_decode_logits(llm, seqs, next_ids)
    same = float((dec["graph"] - dec["same_bucket_eager"]).abs().max())
    _row("engine", "decode logits: graph vs same bucket eager", same == 0.0,
         f"max abs diff {same:.1e} (tol 0: same kernels, same inputs); graph captured: {dec['captured']}",
         max_abs=same, captured=dec["captured"])
    pad_err = _rel(dec["graph"], dec["eager"])
    pad_tol = 1e-5 if plan.model_dtype == "float32" else 2e-2
    _row("engine", "decode logits: padded graph vs unpadded eager", pad_err <= pad_tol,
         f"rel err {pad_err:.2e} (tol {pad_tol:.0e}: other split counts and padding change the rounding only)",
         error=pad_err, tol=pad_tol)
    del llm
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


def build_small_model(plan: Plan, path: Path, tokenizer_dir: str, seed: int) -> Path:
    """A small float32 Llama with widely spread weights, so that greedy choices are clear-cut."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMALL))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def _greedy_reference(hf: Any, prompt: list[int], n: int, device: str) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens by full forwards, with the top-2 logit gap at each step (near-ties)."""
    import torch

    tokens, gaps = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            top = hf(torch.tensor([tokens], device=device)).logits[0, -1].double().topk(2)
            gaps.append(float(top.values[0] - top.values[1]))
            tokens.append(int(top.indices[0]))
    return tokens[len(prompt):], gaps


def _agree(ours: list[int], ref: list[int], gaps: list[float], tie: float = 1e-4) -> bool:
    """Identical, or the first difference is at a near-tie of the reference."""
    t = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    if t is None:
        return len(ours) == len(ref)
    return gaps[t] <= tie


def check_engine_runs(plan: Plan, model_dir: str, rng: random.Random) -> None:
    """On a small float32 model: greedy tokens as transformers'; a seeded sampled batch alone vs batched
    and twice; prefix caching and preemption token-identical to a plain run."""
    import torch
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams
    from transformers import AutoModelForCausalLM

    dev = plan.device
    small = build_small_model(plan, Path(model_dir).parent / "small", model_dir, rng.randrange(2**31))
    hf = AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32).to(dev).eval()
    n_new, vocab = plan.small_new_tokens, SMALL["vocab_size"]
    prompts = [[rng.randrange(20, vocab) for _ in range(rng.randint(1, plan.small_max_prompt))] for _ in range(8)]
    # Blocks of 16: the preemption and prefix-caching checks below count in them.
    kw = dict(dtype="float32", attention_backend="triton", max_num_seqs=16, block_size=16)

    def run(llm: Any, ps: list[list[int]], params: Any = None) -> list[list[int]]:
        params = params or SamplingParams(max_tokens=n_new, ignore_eos=True)
        reqs = [Request(f"q{i}", prompt_token_ids=p, params=params(i) if callable(params) else params)
                for i, p in enumerate(ps)]
        return [c.token_ids for c in llm.generate(reqs)]

    base = LLM(str(small), kv_cache_memory=64 << 20, **kw)
    plain = run(base, prompts)
    refs = [_greedy_reference(hf, p, n_new, dev) for p in prompts]
    agree = sum(_agree(o, r, g) for o, (r, g) in zip(plain, refs, strict=True))
    same = sum(o == r for o, (r, _) in zip(plain, refs, strict=True))
    _row("engine", "greedy tokens vs transformers (float32)", agree == len(prompts),
         f"{same}/{len(prompts)} identical, {agree}/{len(prompts)} identical up to a near-tie (gap <= 1e-4)")

    # Preemption: 8 prompts of at most one block (16 tokens) that each grow past it, in 6 blocks: the
    # running sequences run out of blocks as they grow, and some are preempted and recomputed.
    per_block = 2 * SMALL["num_hidden_layers"] * 16 * SMALL["num_key_value_heads"] * SMALL["head_dim"] * 4
    short = [p[: rng.randint(max(1, 18 - n_new), 15)] for p in prompts]
    tight = LLM(str(small), kv_cache_memory=per_block * 6, max_num_batched_tokens=64, **kw)
    pre, want = run(tight, short), run(base, short)
    _row("engine", "preemption", pre == want and tight.stats["preemptions"] > 0,
         f"{sum(a == b for a, b in zip(pre, want, strict=True))}/{len(short)} identical to a run with room after "
         f"{tight.stats['preemptions']} preemptions in {tight.num_total_blocks} blocks", preemptions=tight.stats["preemptions"])

    system = [rng.randrange(20, vocab) for _ in range(plan.small_max_prompt)]
    shared = [system + p[: plan.small_max_prompt // 2] for p in prompts]
    cached_llm = LLM(str(small), kv_cache_memory=64 << 20, **kw)
    first = run(cached_llm, shared)
    again = run(cached_llm, shared[:3])
    uncached = run(LLM(str(small), kv_cache_memory=64 << 20, enable_prefix_caching=False, **kw), shared)
    hits = cached_llm.stats["prefix_cache_hit_tokens"]
    _row("engine", "prefix caching", first == uncached and again == uncached[:3] and hits >= 3 * len(system) // 16 * 16,
         f"{sum(a == b for a, b in zip(first, uncached, strict=True))}/{len(shared)} identical to no caching, second "
         f"round {sum(a == b for a, b in zip(again, uncached[:3], strict=True))}/3; {hits} prompt tokens hit", hits=hits)

    def seeded(i: int) -> Any:
        return SamplingParams(max_tokens=n_new, ignore_eos=True, temperature=0.9, top_p=0.9, top_k=50,
                              seed=1000 + i, repetition_penalty=1.1 if i % 2 else 1.0)

    sampler = LLM(str(small), kv_cache_memory=64 << 20, **kw)
    batch1 = run(sampler, prompts, seeded)
    batch2 = run(sampler, prompts, seeded)
    alone = [run(sampler, [prompts[i]], lambda _, i=i: seeded(i))[0] for i in (0, 3)]
    differ = sum(a != b for a, b in zip(batch1, plain, strict=True))
    _row("engine", "seeded sampled batch", batch1 == batch2 and alone == [batch1[0], batch1[3]],
         f"twice: {'identical' if batch1 == batch2 else 'DIFFERENT'}; alone vs in the batch: "
         f"{sum(a == batch1[i] for a, i in zip(alone, (0, 3), strict=True))}/2 identical; "
         f"{differ}/{len(prompts)} differ from greedy")


def child_engine(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    rng = random.Random(len(work))
    for check in (lambda: check_engine_logits(plan, model_dir, work), lambda: check_engine_runs(plan, model_dir, rng)):
        try:
            check()
        except Exception as e:  # one broken check must not hide the other
            import traceback

            traceback.print_exc()
            _row("engine", "ERROR", False, f"{type(e).__name__}: {str(e)[:300]}")
    emit("RESULT", {})
