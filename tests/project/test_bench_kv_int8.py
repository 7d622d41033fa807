"""bench/kv_int8_fidelity.py's arithmetic and report: tokens that agree, and the noise floor's row beside
int8's, on outputs it did not have to generate."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

from helpers import fresh_seed

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_kv_int8_fidelity", ROOT / "bench" / "kv_int8_fidelity.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_compare_counts_each_prompts_common_prefix() -> None:
    rng = random.Random(seed := fresh_seed())
    ref = [[rng.randrange(100) for _ in range(rng.randrange(1, 20))] for _ in range(30)]
    other, agree = [], 0
    for tokens in ref:
        cut = rng.randrange(len(tokens) + 1)  # the first difference (len: none)
        other.append(tokens[:cut] + [t + 1000 for t in tokens[cut:]])
        agree += cut
    c = bench.compare(ref, other)
    assert c == {"prompts": 30, "identical_prompts": sum(a == b for a, b in zip(ref, other, strict=True)),
                 "tokens": sum(map(len, ref)), "agreeing_prefix_tokens": agree}, f"seed {seed}"


def run(dtype: str, cache: str, correct: int) -> dict[str, Any]:
    return {"dtype": dtype, "kv_cache_dtype": cache, "kv_blocks": 10, "gsm8k_correct": correct}


def test_report_puts_the_noise_floor_beside_int8() -> None:
    chat = {"prompts": 4, "identical_prompts": 1, "tokens": 40, "agreeing_prefix_tokens": 18}
    floor = {"prompts": 4, "identical_prompts": 3, "tokens": 40, "agreeing_prefix_tokens": 35}
    report = {"model": None, "command": "python x", "max_tokens": 10, "chat": chat, "gsm8k_questions": 5,
              "gsm8k_identical": 2, "noise_floor": {"chat": floor, "gsm8k_identical": 4},
              "runs": [run("bfloat16", "auto", 1), run("bfloat16", "int8", 0), run("float32", "auto", 2)]}
    md = bench.markdown(report)
    assert "| int8 vs 16-bit KV (bfloat16 model) | 1/4 | 18/40 (45%) |" in md
    assert "| bfloat16 vs float32 (model and cache): the noise floor | 3/4 | 35/40 (88%) |" in md
    assert "| float32 | auto | 10 | 2/5 |" in md and "bfloat16 vs float32: 4/5" in md
    del report["noise_floor"]
    assert "noise floor" not in bench.markdown(report)
