"""A real bulk client against Sluice's OpenAI endpoints: lm-evaluation-harness's ``local-completions``
on two small tasks over local data (no downloads), through ``sluice serve`` and one worker.

    python bench/bulk_client.py                                  # the default model (SmolLM2-135M-Instruct)
    python bench/bulk_client.py --model /path/to/model --num-concurrent 16 --out bench/out/lmeval

- ``sluice_mc`` (multiple_choice): each choice is scored by its log-likelihood after the question, which
  lm-eval asks for as ``/v1/completions`` with the prompt's token ids, ``echo: true``, ``logprobs: 1``,
  ``max_tokens: 1`` (Sluice scores the prompt's tokens: engine/prompt_logprobs.py). Metrics: acc, acc_norm.
- ``sluice_gen`` (generate_until): greedy answers cut at a newline; metric: exact_match.

lm-eval lives in its own venv (``--venv``, default /work/venvs/lmeval, made here when missing:
``python -m venv`` + ``pip install lm_eval[api]==0.4.13 transformers==5.24.0``), never in the project's.
It tokenizes with the model's own tokenizer, written by this script to a local folder. The system: an
embedded Valkey in a temporary SLUICE_HOME, ``python -m sluice.worker`` and ``sluice serve`` (as
bench/online_throughput.py starts them). Prints lm-eval's table and a summary; the results and every
sample (``--log_samples``) are written under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from online_throughput import QUEUE, private_home, start_system, stop_system  # noqa: E402 - bench/ is not a package

LM_EVAL = "lm_eval[api]==0.4.13"
TRANSFORMERS = "transformers==5.24.0"  # for lm-eval's tokenizer (no torch: tokenizers only)
DEFAULT_VENV = Path(os.environ.get("SLUICE_LMEVAL_VENV", "/work/venvs/lmeval"))

# Local data: short, unambiguous questions a small instruct model can mostly get right.
MC = [
    ("What color is the sky on a clear day?", ["blue", "green", "red", "black"], 0),
    ("How many legs does a dog have?", ["two", "four", "six", "eight"], 1),
    ("What is the opposite of hot?", ["warm", "loud", "cold", "tall"], 2),
    ("Which animal says moo?", ["cat", "dog", "duck", "cow"], 3),
    ("What do bees make?", ["honey", "milk", "silk", "wool"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand", "glass"], 1),
    ("Which planet do we live on?", ["Mars", "Venus", "Earth", "Jupiter"], 2),
    ("How many days are in a week?", ["five", "six", "eight", "seven"], 3),
    ("What is the capital of France?", ["Paris", "Berlin", "Madrid", "Rome"], 0),
    ("Which season comes after winter?", ["autumn", "spring", "summer", "winter"], 1),
    ("What do you use to write on paper?", ["a spoon", "a shoe", "a pen", "a cup"], 2),
    ("Which is the largest ocean?", ["Arctic", "Indian", "Atlantic", "Pacific"], 3),
    ("What gas do plants take in from the air?", ["carbon dioxide", "helium", "neon", "argon"], 0),
    ("What is two plus two?", ["three", "four", "five", "six"], 1),
    ("Which fruit is yellow and curved?", ["apple", "grape", "banana", "cherry"], 2),
    ("Where do fish live?", ["in trees", "in deserts", "in clouds", "in water"], 3),
]
GEN = [
    ("The capital of France is", "Paris"), ("The color of grass is", "green"),
    ("Two plus three equals", "5"), ("The first month of the year is", "January"),
    ("The opposite of up is", "down"), ("The largest planet in the solar system is", "Jupiter"),
    ("Ice is frozen", "water"), ("A baby cat is called a", "kitten"),
]


def ensure_venv(venv: Path) -> Path:
    """The venv's ``lm_eval`` executable, installing lm-eval there first when it is missing."""
    exe = venv / "bin" / "lm_eval"
    if exe.exists():
        return exe
    print(f"creating {venv} with {LM_EVAL} (a few minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", LM_EVAL, TRANSFORMERS], check=True)
    return exe


def write_tasks(where: Path) -> None:
    """Two lm-eval task YAMLs over local JSONL files (read by the datasets ``json`` builder: no hub)."""
    mc = where / "mc.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in MC))
    gen = where / "gen.jsonl"
    gen.write_text("".join(json.dumps({"prompt": p, "target": t}) + "\n" for p, t in GEN))
    (where / "sluice_mc.yaml").write_text(f"""task: sluice_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    (where / "sluice_gen.yaml").write_text(f"""task: sluice_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: [" "]
""")


def save_tokenizer(model: str | None, where: Path) -> Path:
    """The model's tokenizer as a plain folder lm-eval can read (the default model is a GGUF file)."""
    from sluice.engine.loader import load_tokenizer

    path = where / "tokenizer"
    load_tokenizer(model).save_pretrained(path)
    return path


def run_lm_eval(exe: Path, url: str, tokenizer: Path, tasks: Path, out: Path, args: argparse.Namespace) -> float:
    model_args = ",".join([f"model={QUEUE}", f"base_url={url}/v1/completions", f"tokenizer={tokenizer}",
                           "tokenizer_backend=huggingface", "tokenized_requests=True",
                           f"num_concurrent={args.num_concurrent}", "max_retries=1", "timeout=600"])
    cmd = [str(exe), "--model", "local-completions", "--model_args", model_args, "--tasks", "sluice_mc,sluice_gen",
           "--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", str(args.batch_size)]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OPENAI_API_KEY": os.environ.get("SLUICE_API_KEY", "unused"), "PYTHONPATH": ""}
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, check=True)
    return time.monotonic() - t0


def summary(out: Path) -> dict[str, Any]:
    """The newest results file lm-eval wrote under ``out``, and a few of its samples."""
    results = max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    data = json.loads(results.read_text())
    got: dict[str, Any] = {"results_file": str(results), "results": data["results"], "samples": {}}
    for task in ("sluice_mc", "sluice_gen"):
        files = sorted(results.parent.glob(f"samples_{task}_*.jsonl"))
        rows = [json.loads(x) for x in files[-1].read_text().splitlines()] if files else []
        got["samples"][task] = len(rows)
        for row in rows[:3]:
            print(f"{task} doc {row['doc_id']}: filtered={row['filtered_resps']} target={row['target']!r}")
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path or name (default: the worker's, SmolLM2-135M-Instruct)")
    p.add_argument("--venv", type=Path, default=DEFAULT_VENV, help="lm-eval's own venv (made when missing)")
    p.add_argument("--num-concurrent", type=int, default=16, help="lm-eval's concurrent requests")
    p.add_argument("--batch-size", type=int, default=1,
                   help="lm-eval's --batch_size: prompts per /v1/completions request (a list prompt)")
    p.add_argument("--limit", type=int, default=None, help="lm-eval's --limit: documents per task")
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--worker-args", default="", help="extra `python -m sluice.worker` flags, e.g. '--dtype float32'")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "lmeval", help="lm-eval's output folder")
    args = p.parse_args()

    exe = ensure_venv(args.venv)
    with tempfile.TemporaryDirectory(prefix="sluice-bulk-") as tmp:
        home = private_home(Path(tmp))
        write_tasks(Path(tmp))
        tokenizer = save_tokenizer(args.model, Path(tmp))
        procs, url = start_system(args, home, {**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            wall = run_lm_eval(exe, url, tokenizer, Path(tmp), args.out, args)
        finally:
            stop_system(procs, home)
    got = summary(args.out)
    print(json.dumps({"client": LM_EVAL, "model": args.model or "SmolLM2-135M-Instruct", "wall_s": round(wall, 1),
                      "results": got["results"], "samples": got["samples"], "results_file": got["results_file"]},
                     indent=2))


if __name__ == "__main__":
    main()
