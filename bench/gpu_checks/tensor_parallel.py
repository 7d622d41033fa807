"""The tp section: tensor parallelism (engine/parallel/) against one device, greedy tokens identical."""

from __future__ import annotations

import random
import time

from bench.gpu_checks.common import Plan, Reporter
from bench.gpu_checks.engine import SMALL, build_small_model
from bench.gpu_checks.sections import Prepared


def tensor_parallel_section(plan: Plan, prep: Prepared, rng: random.Random, rows: Reporter) -> bool:
    """Greedy tokens of TP=2 (NCCL, one GPU per rank; gloo in a dry run) identical to TP=1 on the small float32
    model, with preemption and chunked prefill. Needs two devices: NCCL cannot put two ranks on one GPU, so on
    a one-GPU machine the row says it was skipped."""
    import torch
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

    if plan.device == "cuda" and torch.cuda.device_count() < 2:
        rows.append(("tp", "TP=2 vs TP=1 greedy tokens", "SKIP", f"{torch.cuda.device_count()} CUDA device: TP=2 "
                     "needs one per rank (NCCL)"))
        return True
    small = build_small_model(plan, prep.model_dir.parent / "small-tp", str(prep.model_dir), rng.randrange(2**31))
    prompts = [[rng.randrange(20, SMALL["vocab_size"]) for _ in range(rng.randint(1, plan.small_max_prompt))]
               for _ in range(8)]
    per_block = 2 * SMALL["num_hidden_layers"] * 16 * SMALL["num_key_value_heads"] * SMALL["head_dim"] * 4
    tokens, stats, secs = {}, {}, {}
    for tp in (1, 2):
        # The dry run takes PyTorch attention: the interpreted kernels are checked elsewhere, this is about the ranks.
        llm = LLM(str(small), dtype="float32", attention_backend="triton" if plan.device == "cuda" else "torch",
                  tensor_parallel_size=tp, max_num_seqs=8, max_num_batched_tokens=32, kv_cache_memory=per_block * 6 // tp,
                  block_size=16)  # per_block counts 16-token blocks
        try:
            t0 = time.monotonic()
            reqs = [Request(f"t{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=plan.small_new_tokens + 12,
                                                                                  ignore_eos=True))
                    for i, p in enumerate(prompts)]
            tokens[tp] = [c.token_ids for c in llm.generate(reqs)]
            secs[tp], stats[tp] = time.monotonic() - t0, llm.stats
        finally:
            llm.close()
    same = sum(a == b for a, b in zip(tokens[1], tokens[2], strict=True))
    rows.append(("tp", "TP=2 vs TP=1 greedy tokens", "PASS" if same == len(prompts) else "FAIL",
                 f"{same}/{len(prompts)} identical, {stats[2]['preemptions']} preemptions at TP=2; "
                 f"{secs[1]:.1f}s vs {secs[2]:.1f}s"), preemptions=stats[2]["preemptions"])
    return same == len(prompts)
