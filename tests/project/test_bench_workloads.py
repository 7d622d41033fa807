"""bench/workloads.py: the prompts and sampling settings of each --workload, built from the real prompt
sets and the default model's tokenizer (no timing); and bench/throughput.py's per-workload defaults."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from sluice.engine.loader import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import workloads  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_throughput", ROOT / "bench" / "throughput.py")
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

pytestmark = pytest.mark.skipif(not (workloads.PROMPTS / "mt_bench.jsonl").exists(),
                                reason="the shared prompt sets are not beside the project")


@pytest.fixture(scope="module")
def tok() -> object:
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return workloads.read_rows()


def test_chat_is_the_first_turns_as_one_turn_chats(tok: object, rows: list[dict]) -> None:
    ids = workloads.build("chat", tok, 170, rows)
    assert len(ids) == 170 and len(rows) == 160
    text = tok.decode(ids[3])
    assert rows[3]["turns"][0] in text and text.rstrip().endswith("assistant")
    assert ids[160] == ids[0]  # the sets repeat to make up the number
    assert workloads.build("sampled", tok, 5, rows) == ids[:5]


def test_long_prompts_are_long_distinct_and_seeded(tok: object, rows: list[dict]) -> None:
    ids = workloads.build("long-prompt", tok, 12, rows)
    lo, hi = workloads.LONG_TOKENS
    assert all(lo <= len(x) <= hi for x in ids), [len(x) for x in ids]
    assert len({tuple(x) for x in ids}) == 12
    assert max(map(len, ids)) - min(map(len, ids)) > 200  # the lengths are drawn, not all alike
    text = tok.decode(ids[0])
    assert text.count("\n\n") > 10 and workloads.SUMMARISE.strip() in text and "1. " in text
    assert workloads.build("long-prompt", tok, 12, rows) == ids


def test_few_shot_prompts_share_a_prefix_of_worked_examples(tok: object, rows: list[dict]) -> None:
    ids = workloads.build("few-shot", tok, 20, rows)
    prefix = tok.encode(workloads.few_shot_prefix(rows, tok), add_special_tokens=False)
    assert workloads.FEW_SHOT_TOKENS <= len(prefix) < workloads.FEW_SHOT_TOKENS + 300
    assert all(x[: len(prefix)] == prefix for x in ids)
    assert len({tuple(x[len(prefix):]) for x in ids}) == 20
    examples = tok.decode(prefix)
    assert examples.count("\n\nQuestion: ") >= examples.count("\nAnswer: ") >= 8
    tail = tok.decode(ids[7][len(prefix):])
    assert tail.startswith("Question: " + rows[7]["turns"][0].strip()[:20]) and tail.endswith("\nAnswer:")
    assert workloads.FEW_SHOT_STOP.strip() in examples  # the stop string ends an answer in the examples too


def test_unknown_workload_is_refused(tok: object, rows: list[dict]) -> None:
    with pytest.raises(ValueError, match="workload must be one of"):
        workloads.build("chatty", tok, 3, rows)


def test_each_workload_has_its_defaults_and_chat_keeps_the_old_ones() -> None:
    chat = bench.parse_args([])
    assert (chat.workload, chat.num_prompts, chat.max_tokens, chat.temperature) == ("chat", 160, 256, 0.0)
    assert chat.sampling == workloads.Sampling()
    hot = bench.parse_args(["--temperature", "0.7"])
    assert hot.sampling.temperature == 0.7 and hot.sampling.seed == 0
    sampled = bench.parse_args(["--workload", "sampled"])
    assert sampled.sampling == workloads.Sampling(temperature=0.8, top_p=0.95, top_k=50, n=4, seed=0)
    long = bench.parse_args(["--workload", "long-prompt", "--num-prompts", "7"])
    assert (long.num_prompts, long.max_tokens) == (7, 64) and 64 <= long.max_tokens <= 128
    few = bench.parse_args(["--workload", "few-shot"])
    assert few.sampling.stop == [workloads.FEW_SHOT_STOP] and few.sampling.temperature == 0


def test_prompt_rate_and_its_table() -> None:
    r = bench.with_prompt_rate({"system": "sluice", "dtype": "float32", "seconds": 2.0, "tokens_per_s": 5.0,
                                "output_tokens": 10, "prompts": 8}, [[1] * 30, [2] * 10])
    assert r["prompt_tokens"] == 40 and r["prompt_tokens_per_s"] == 20.0
    assert bench.with_prompt_rate({"error": "exit 1"}, [[1]]) == {"error": "exit 1"}
    args = bench.parse_args(["--workload", "sampled", "--systems", "sluice,vllm"])
    vllm = {"system": "vllm", "dtype": "float32", "error": "exit 1"}
    table = bench.markdown({"float32": {"sluice": r, "vllm": vllm}}, args.systems, args, "header")
    lines = table.splitlines()
    assert "| system | float32 prompt tok/s |" in lines
    assert "| Sluice continuous (`max_num_seqs` 256) | 20.0 |" in lines
    assert any("refuses a seed per request" in x for x in lines)
    assert not any("refuses" in x for x in bench.markdown({"float32": {"sluice": r}}, ["sluice"], bench.parse_args([]),
                                                          "h").splitlines())
