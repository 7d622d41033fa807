"""What the int8 KV cache (``--kv-cache-dtype int8``) does to outputs: greedy tokens and GSM8K accuracy, 16-bit
cache against int8, the same model and dtype; beside it the noise floor, the 16-bit model and cache against
float32 (``--reference-dtype``: what any 16-bit rounding already does). Accuracy, not speed: a busy machine
is fine.

    python bench/kv_int8_fidelity.py                          # the default model (SmolLM2-135M-Instruct)
    python bench/kv_int8_fidelity.py --num-chat 8 --num-gsm8k 8 --tag kv8-fidelity-smoke   # a quick check

1. Chat: the first turn of each prompt of the shared prompt sets (bench/workloads.py's chat workload),
   ``--max-tokens`` greedy tokens with each cache. Reported: prompts whose tokens are identical, and
   tokens that agree (each prompt's common prefix: after the first difference the texts diverge, and
   later tokens compare nothing).
2. GSM8K: the first ``--num-gsm8k`` test questions after a few-shot prompt of the first 8 training
   examples ("Question: ...\\nAnswer: <its worked answer ending in #### N>"), greedy; a reply is right when
   the number after its first ``####`` (else its last number) equals the reference's.

Writes bench/out/TAG.json and TAG.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402  (bench/workloads.py, beside this file)

OUT = HERE / "out"
SHOTS = 8
GSM8K_STOP = "\n\nQuestion:"


def few_shot_prompt(train: list[dict[str, str]], question: str) -> str:
    shots = "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in train[:SHOTS])
    return f"{shots}Question: {question}\nAnswer:"


def number_of(text: str) -> str | None:
    """The answer a GSM8K reply gives: the number after ``####``, else the last number in it."""
    marked = re.search(r"####\s*(-?[\d,]*\.?\d+)", text)
    found = [marked.group(1)] if marked else re.findall(r"-?[\d,]*\.?\d+", text)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".0") else value


def read_jsonl(path: Path, n: int | None = None) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return rows[:n] if n is not None else rows


def run_cache(dtype: str, kv_cache_dtype: str, args: argparse.Namespace, chat: list[list[int]],
              gsm: list[str]) -> dict[str, Any]:
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams
    from sluice.jobs.units import parse_size

    memory = parse_size(args.kv_cache_memory) if args.kv_cache_memory else None
    llm = LLM(args.model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=memory)
    t0 = time.perf_counter()
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    chat_out = llm.generate([Request(f"c{i}", prompt_token_ids=p, params=greedy) for i, p in enumerate(chat)])
    gsm_params = SamplingParams(max_tokens=args.gsm8k_max_tokens, temperature=0.0, stop=[GSM8K_STOP])
    gsm_out = llm.generate([Request(f"g{i}", prompt=p, params=gsm_params) for i, p in enumerate(gsm)])
    return {"kv_cache_dtype": kv_cache_dtype, "dtype": str(llm.runner.dtype).removeprefix("torch."),
            "kv_blocks": llm.num_total_blocks, "seconds": time.perf_counter() - t0,
            "chat_tokens": [c.outputs[0].token_ids for c in chat_out], "gsm8k_texts": [c.text for c in gsm_out]}


def compare(ref: list[list[int]], other: list[list[int]]) -> dict[str, int]:
    identical = sum(a == b for a, b in zip(ref, other, strict=True))
    agree = 0
    for a, b in zip(ref, other, strict=True):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        agree += n
    return {"prompts": len(ref), "identical_prompts": identical, "tokens": sum(map(len, ref)),
            "agreeing_prefix_tokens": agree}


def accuracy(texts: list[str], answers: list[str]) -> int:
    return sum(number_of(t) == number_of(a) for t, a in zip(texts, answers, strict=True))


def chat_line(what: str, c: dict[str, int]) -> str:
    return (f"| {what} | {c['identical_prompts']}/{c['prompts']} | {c['agreeing_prefix_tokens']}/{c['tokens']} "
            f"({c['agreeing_prefix_tokens'] / max(c['tokens'], 1):.0%}) |")


def markdown(report: dict[str, Any]) -> str:
    runs, n = report["runs"], report["gsm8k_questions"]
    lines = [f"# int8 KV cache fidelity ({report['model'] or 'SmolLM2-135M-Instruct'}, {runs[0]['dtype']})", "",
             f"Command: `{report['command']}`", "",
             f"Chat (greedy, {report['max_tokens']} tokens): prompts whose tokens are identical, and tokens that "
             "agree before the first difference.", "",
             "| compared | identical prompts | agreeing tokens |", "| --- | --- | --- |",
             chat_line(f"int8 vs 16-bit KV ({runs[0]['dtype']} model)", report["chat"])]
    if "noise_floor" in report:
        lines.append(chat_line(f"{runs[0]['dtype']} vs {runs[2]['dtype']} (model and cache): the noise floor",
                               report["noise_floor"]["chat"]))
    lines += ["", "| model dtype | KV cache | KV blocks | GSM8K correct |", "| --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r['dtype']} | {r['kv_cache_dtype']} | {r['kv_blocks']} | {r['gsm8k_correct']}/{n} |")
    lines += ["", f"GSM8K answers identical, int8 vs 16-bit KV: {report['gsm8k_identical']}/{n}"]
    if "noise_floor" in report:
        lines.append(f"GSM8K answers identical, {runs[0]['dtype']} vs {runs[2]['dtype']}: "
                     f"{report['noise_floor']['gsm8k_identical']}/{n}")
    return "\n".join(lines) + "\n"


def same_answers(a: list[str], b: list[str]) -> int:
    return sum(number_of(x) == number_of(y) for x, y in zip(a, b, strict=True))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--reference-dtype", default="float32",
                   help="the noise floor's model and cache dtype, against --dtype with a 16-bit cache; 'none': skip it")
    p.add_argument("--num-chat", type=int, default=80, help="chat prompts (the prompt sets cycled)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-gsm8k", type=int, default=200)
    p.add_argument("--gsm8k-max-tokens", type=int, default=256)
    p.add_argument("--gsm8k-dir", type=Path, default=Path("/tmp/gsm8k"), help="test.jsonl and train.jsonl")
    p.add_argument("--kv-cache-memory", default="1GiB",
                   help="each run's KV budget (sluice's --kv-cache-memory); '': the engine's own sizing")
    p.add_argument("--tag", default="kv8-fidelity")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from sluice.engine.loader import load_tokenizer

    tok = load_tokenizer(args.model)
    chat = workloads.chat_ids(tok, workloads.read_rows(), args.num_chat)
    train = read_jsonl(args.gsm8k_dir / "train.jsonl", SHOTS)
    test = read_jsonl(args.gsm8k_dir / "test.jsonl", args.num_gsm8k)
    prompts = [few_shot_prompt(train, r["question"]) for r in test]
    pairs = [(args.dtype, "auto"), (args.dtype, "int8")]
    if args.reference_dtype != "none":
        pairs.append((args.reference_dtype, "auto"))
    runs = [run_cache(dtype, cache, args, chat, prompts) for dtype, cache in pairs]
    answers = [r["answer"] for r in test]
    for r in runs:
        r["gsm8k_correct"] = accuracy(r["gsm8k_texts"], answers)
        print(f"{r['dtype']} {r['kv_cache_dtype']}: {r['kv_blocks']} KV blocks, GSM8K {r['gsm8k_correct']}/{len(test)}, "
              f"{r['seconds']:.0f}s", flush=True)
    report = {"model": args.model, "command": " ".join(["python", *sys.argv]), "max_tokens": args.max_tokens,
              "chat": compare(runs[0]["chat_tokens"], runs[1]["chat_tokens"]), "gsm8k_questions": len(test),
              "gsm8k_identical": same_answers(runs[0]["gsm8k_texts"], runs[1]["gsm8k_texts"]), "runs": runs}
    if len(runs) > 2:
        report["noise_floor"] = {"chat": compare(runs[2]["chat_tokens"], runs[0]["chat_tokens"]),
                                 "gsm8k_identical": same_answers(runs[2]["gsm8k_texts"], runs[0]["gsm8k_texts"])}
    OUT.mkdir(exist_ok=True)
    (OUT / f"{args.tag}.json").write_text(json.dumps(report))
    (OUT / f"{args.tag}.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
