"""Structured output's cost: one batch free, then the same batch with half its requests constrained.

    python bench/guided_throughput.py                               # 64 prompts x 128 tokens, SmolLM2
    python bench/guided_throughput.py --num-prompts 16 --max-tokens 32 --repeats 2

Both runs do the same work: every request runs to ``max_tokens`` (free ones with ``ignore_eos``, the
constrained ones under a grammar that never lets them end), so the batch shape is identical step for step
and the difference is the masking alone (bitmask fill, transfer, apply, matcher advance). The constrained
half alternates a JSON-ish grammar and a regex so the matchers do real work. Reports output tokens/s of
each run (best of ``--repeats``) and their ratio; the target is >= 0.80.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts" / "vicuna_bench.jsonl"
# Grammars with no end: a constrained request runs to max_tokens just like an ignore_eos free one.
ENDLESS = [
    'root ::= "[" item ("," item)* "]\\n" root\nitem ::= "{\\"k\\": " [0-9]+ ", \\"v\\": \\"" [a-z ]* "\\"}"',
    'root ::= [a-zA-Z ,.]+ "\\u0001" root',
]


def prompts(n: int) -> list[str]:
    if PROMPTS.exists():
        rows = [json.loads(x)["turns"][0] for x in PROMPTS.read_text().splitlines() if x.strip()]
    else:
        rows = ["Write a short story about a robot.", "Explain photosynthesis.", "List some rivers in Asia."]
    return (rows * (n // len(rows) + 1))[:n]


def requests(texts: list[str], max_tokens: int, constrained: bool, tag: str) -> list[Request]:
    out = []
    for i, t in enumerate(texts):
        guided = {"guided_grammar": ENDLESS[i // 2 % 2]} if constrained and i % 2 else {}
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=not guided, **guided)
        out.append(Request(f"{tag}-{i}", messages=[{"role": "user", "content": t}], params=params))
    return out


def run(llm: LLM, reqs: list[Request]) -> float:
    t0 = time.perf_counter()
    done = llm.generate(reqs)
    dt = time.perf_counter() - t0
    assert all(c.finish_reason == "length" for c in done), [c.finish_reason for c in done]
    return sum(c.usage.completion_tokens for c in done) / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    llm = LLM(args.model, dtype=args.dtype)
    texts = prompts(args.num_prompts)
    for g in ENDLESS:  # compile outside the timed runs (the cache keeps them, as in a long batch)
        llm.guided.compile(SamplingParams(guided_grammar=g))
    run(llm, requests(texts[:4], 4, True, "warmup"))
    free, half = [], []
    for r in range(args.repeats):  # interleaved, so drift in machine load hits both alike
        free.append(run(llm, requests(texts, args.max_tokens, False, f"free{r}")))
        half.append(run(llm, requests(texts, args.max_tokens, True, f"half{r}")))
    print(f"device={llm.device} dtype={llm.dtype} prompts={args.num_prompts} max_tokens={args.max_tokens}")
    print(f"free:             {max(free):8.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in free)})")
    print(f"half constrained: {max(half):8.1f} tok/s  (runs: {', '.join(f'{x:.1f}' for x in half)})")
    print(f"ratio: {max(half) / max(free):.3f} (target >= 0.80)")


if __name__ == "__main__":
    main()
