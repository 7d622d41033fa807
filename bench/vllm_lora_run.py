"""vLLM's CPU build on bench/lora_throughput.py's workload with K of its adapters, in vLLM's own venv.

    bench/.vllm-venv/bin/python bench/vllm_lora_run.py WORKLOAD.json RESULT.json --adapters 4

Run by bench/lora_throughput.py --vllm (with bench/throughput.py's threads, tcmalloc and libiomp5 in
the environment); imports nothing from the project. Line i runs on adapter i mod K (K = 0: the base),
greedy, EOS ignored, as Sluice's runs; ``max_loras`` is K, so every adapter may be in one batch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", type=Path)
    p.add_argument("result", type=Path)
    p.add_argument("--adapters", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="bytes")
    args = p.parse_args()
    w = json.loads(args.workload.read_text())
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    adapters = list(w["adapters"].items())[: args.adapters]
    kw: dict[str, Any] = {}
    if adapters:
        kw.update(enable_lora=True, max_loras=len(adapters), max_lora_rank=w["rank"])
    llm = LLM(model=w["model_dir"], dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=0,
              kv_cache_memory_bytes=args.kv_cache_memory, **kw)
    requests = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters)]

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        lora = [requests[i % len(requests)] for i in range(len(prompts))] if requests else None
        outs = llm.generate([TokensPrompt(prompt_token_ids=x) for x in prompts], params, lora_request=lora,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    ids = w["prompt_token_ids"]
    generate([x[:8] for x in ids[: max(len(requests), 1)]], 4)  # every adapter loaded, off the clock
    t = time.perf_counter()
    outputs = generate(ids, w["max_tokens"])
    secs = time.perf_counter() - t
    tokens = sum(map(len, outputs))
    result = {"adapters": len(adapters), "seconds": secs, "output_tokens": tokens, "tokens_per_s": tokens / secs,
              "vllm": vllm.__version__}
    args.result.write_text(json.dumps(result))
    print(f"vllm, {len(adapters)} adapters: {tokens / secs:.1f} tok/s ({tokens} tokens, {secs:.1f}s)", flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
