"""Planning a batch by shared prefixes (issue 44): prompt tokens computed and tokens/s, arrival order vs
planned, in-process (`sluice generate`) and on the queue with two single-thread workers, and vLLM's
`run-batch` on the same file.

    python bench/prefix_plan.py --gsm8k PATH/grade-school-math/grade_school_math/data
    python bench/prefix_plan.py --gsm8k DIR --workloads fewshot4 --systems arrival,planned --lines 64

Workloads (real text: GSM8K, github.com/openai/grade-school-math, MIT; give its data directory, which
holds train.jsonl and test.jsonl; ../shared/data/gsm8k/ is read when present):
- fewshotK (K = 4, 16): GSM8K test questions, each behind one of K different 8-shot prefixes (a system
  turn and 8 train question/answer pairs as chat turns), lines shuffled;
- rag: documents of about 1,500 tokens (runs of consecutive train problems with their solutions), 8
  questions about each ("What is the final answer of problem N above?"), lines shuffled.
The KV cache (``--kv-cache-memory``) is set to hold only some of the prefixes at once.

Systems: arrival (`sluice generate --arrival-order`), planned (`sluice generate`), arrival-2w and
planned-2w (the batch submitted to a fresh embedded job server, arrival order or planned, and run by two
`sluice worker` processes pinned to one core and one thread each), vllm (vLLM's CPU build's
`run_batch`, prefix caching on, in its own venv, bench/vllm_env.sh; timed by its own progress bar, from
reading the batch to its last line, start-up left out, to 1 s). Each runs in its own process(es)
on the same file; best of ``--runs``. Prompt tokens computed = prompt tokens - cached prompt tokens, from
each output line's usage. Minimum: each distinct prefix once per worker (its whole blocks), plus every
prompt's own remainder. Writes bench/out/prefix-plan-TAG.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from throughput import OUT, describe_cpu, machine, vllm_env  # noqa: E402

SHARED_GSM8K = ROOT.parent / "shared" / "data" / "gsm8k"
SYSTEMS = ("arrival", "planned", "arrival-2w", "planned-2w", "vllm")
SHOTS = 8
QUESTIONS_PER_DOC = 8


def load(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fewshot_lines(data: Path, k: int, n: int, rng: random.Random, max_tokens: int) -> list[dict[str, Any]]:
    train, test = load(data / "train.jsonl"), load(data / "test.jsonl")
    prefixes = []
    for g in range(k):
        shots = rng.sample(train, SHOTS)
        turns = [m for s in shots for m in ({"role": "user", "content": s["question"]},
                                            {"role": "assistant", "content": s["answer"]})]
        prefixes.append([{"role": "system", "content": f"Solve the problem step by step (style {g})."}, *turns])
    questions = rng.sample(test, n)
    return [{"custom_id": f"q{i}", "messages": [*prefixes[i % k], {"role": "user", "content": q["question"]}],
             "max_tokens": max_tokens} for i, q in enumerate(questions)]


def rag_lines(data: Path, n: int, rng: random.Random, max_tokens: int) -> list[dict[str, Any]]:
    train = load(data / "train.jsonl")
    docs = -(-n // QUESTIONS_PER_DOC)
    out = []
    for d in range(docs):
        start = rng.randrange(len(train) - 12)
        problems = train[start : start + 12]  # ~1,500 tokens of real text
        doc = "\n\n".join(f"Problem {i + 1}. {p['question']}\nSolution: {p['answer']}" for i, p in enumerate(problems))
        for q in range(QUESTIONS_PER_DOC):
            out.append({"custom_id": f"d{d}q{q}", "max_tokens": max_tokens, "messages": [
                {"role": "user", "content": f"{doc}\n\nWhat is the final answer of problem {q + 1} above?"}]})
    return out[:n]


def workload(name: str, data: Path, n: int, max_tokens: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    lines = rag_lines(data, n, rng, max_tokens) if name == "rag" else \
        fewshot_lines(data, int(name.removeprefix("fewshot")), n, rng, max_tokens)
    rng.shuffle(lines)  # arrival order: shuffled, as real files often are
    return lines


# ---- systems -----------------------------------------------------------------------------------------
def sluice_bin() -> str:
    return str(Path(sys.executable).parent / "sluice")


def run_generate(src: Path, out: Path, args: argparse.Namespace, planned: bool, log: Path) -> float:
    cmd = [sluice_bin(), "generate", str(src), "-o", str(out), "--dtype", args.dtype, "--no-progress",
           "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs)]
    if not planned:
        cmd.append("--arrival-order")
    t = time.perf_counter()
    with log.open("ab") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    return time.perf_counter() - t


def run_two_workers(lines: list[dict[str, Any]], out: Path, args: argparse.Namespace, planned: bool,
                    log: Path) -> float:
    home = Path(tempfile.mkdtemp(prefix="sluice-plan-"))
    env = {**os.environ, "SLUICE_HOME": str(home), "OMP_NUM_THREADS": "1"}
    env.pop("SLUICE_REDIS_URL", None)
    code = """
import json, sys, time
from sluice.jobs.connection import connect
from sluice.jobs.submit import submit
from sluice.jobs.store import get_batch
lines = [json.dumps(x) for x in json.load(open(sys.argv[1]))]
r = connect()
t = time.perf_counter()
b = submit(lines, r=r, model="bench", plan=sys.argv[2] == "1")
while not get_batch(r, b.id).is_final:
    time.sleep(0.1)
print(b.id, time.perf_counter() - t)
"""
    spec = out.with_suffix(".lines.json")
    spec.write_text(json.dumps(lines))
    workers = []
    with log.open("ab") as f:
        for core in sorted(os.sched_getaffinity(0))[:2]:
            cmd = ["taskset", "-c", str(core), sluice_bin(), "worker", "--queue", "bench", "--dtype", args.dtype,
                   "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(args.max_num_seqs),
                   "--worker-id", f"w{core}", "--exit-when-idle", "3"]
            workers.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT))
        # The workers load their model before the clock starts: submit once both heartbeat.
        wait = [sys.executable, "-c", "import time; from sluice.jobs.connection import connect; from sluice.jobs.store "
                "import list_workers\nr = connect()\nwhile len(list_workers(r)) < 2: time.sleep(0.2)"]
        subprocess.run(wait, env=env, check=True, timeout=600)
        done = subprocess.run([sys.executable, "-c", code, str(spec), "1" if planned else "0"], env=env,
                              check=True, capture_output=True, text=True)
        batch_id, seconds = done.stdout.split()
        subprocess.run([sluice_bin(), "results", batch_id, "-o", str(out)], env=env, check=True, stdout=f,
                       stderr=subprocess.STDOUT)
        for w in workers:
            w.wait(timeout=120)
        subprocess.run([sluice_bin(), "server", "stop"], env=env, stdout=f, stderr=subprocess.STDOUT)
    return float(seconds)


def run_vllm(src: Path, out: Path, args: argparse.Namespace, log: Path) -> float:
    from sluice.engine.loader import dense_path, resolve_model

    venv = HERE / ".vllm-venv"
    model_dir = dense_path(resolve_model(None))
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.run_batch", "-i", str(src), "-o", str(out),
           "--model", str(model_dir), "--dtype", args.dtype, "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--max-num-seqs", str(args.max_num_seqs),
           "--kv-cache-memory-bytes", str(parse_size(args.kv_cache_memory)),
           # vLLM refuses a KV cache that cannot hold one sequence of the model's full length (8,192 here)
           "--max-model-len", "4096"]
    start = log.stat().st_size if log.exists() else 0
    t = time.perf_counter()
    with log.open("ab") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env=vllm_env(venv))
    whole = time.perf_counter() - t
    with log.open("rb") as f:
        f.seek(start)
        batch = vllm_batch_seconds(f.read().decode(errors="replace"))
    # Its batch alone, as the two-worker runs time theirs: vLLM's start-up (about a minute, mostly compiling)
    # would otherwise be most of its time and flatter us.
    return batch if batch is not None else whole


def vllm_batch_seconds(log_text: str) -> float | None:
    """run_batch's own time for the batch, from its progress bar's last line (``... | 64/64 [00:31<00:00, ...``)."""
    done = re.findall(r"Running batch: 100% Completed \| (\d+)/\1 \[(?:(\d+):)?(\d+):(\d+)<", log_text)
    if not done:
        return None
    _, h, m, sec = done[-1]
    return 3600 * int(h or 0) + 60 * int(m) + int(sec)


def parse_size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(float(text[: -len(u)]) * m)
    return int(text)


# ---- counting ----------------------------------------------------------------------------------------
def usage_of(out: Path) -> dict[str, int]:
    prompt = cached = completion = failed = 0
    for line in out.read_text().splitlines():
        row = json.loads(line)
        body = (row.get("response") or {}).get("body") or {}
        u = body.get("usage")
        if not u:
            failed += 1
            continue
        prompt += u["prompt_tokens"]
        cached += (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        completion += u["completion_tokens"]
    return {"prompt": prompt, "cached": cached, "computed": prompt - cached, "completion": completion,
            "failed": failed}


def minimum_computed(lines: list[dict[str, Any]], workers: int, block: int) -> int:
    """The least prompt tokens a prefix cache of whole blocks can leave to compute: each distinct chain of
    whole blocks (a block and everything before it) once per worker that could need it, plus each prompt's
    tokens after its last cacheable block (the last token is always computed). Shared blocks are found
    across groups too (a template's default system turn, a common opening)."""
    from sluice.engine.loader import load_tokenizer

    tok = load_tokenizer(None)
    users: dict[int, int] = {}  # a chain of whole blocks (its hash, as the prefix cache keys it) -> prompts
    tails = 0
    for x in lines:
        t = tok.apply_chat_template(x["messages"], add_generation_prompt=True, tokenize=True)
        ids = list(t["input_ids"] if hasattr(t, "keys") else t)
        cacheable = (len(ids) - 1) // block
        chain = 0
        for b in range(cacheable):
            chain = hash((chain, tuple(ids[b * block : (b + 1) * block])))
            users[chain] = users.get(chain, 0) + 1
        tails += len(ids) - cacheable * block
    return tails + block * sum(min(n, workers) for n in users.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gsm8k", type=Path, default=SHARED_GSM8K, help="GSM8K's data directory")
    p.add_argument("--workloads", default="fewshot4,fewshot16,rag")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--lines", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="96MiB",
                   help="KV cache bytes: 96MiB holds about 4,200 tokens of the default model, two 8-shot prefixes")
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--tag", default="run")
    args = p.parse_args()
    if not (args.gsm8k / "test.jsonl").exists():
        sys.exit(f"no GSM8K at {args.gsm8k}: give --gsm8k DIR (grade-school-math's grade_school_math/data)")
    OUT.mkdir(exist_ok=True)
    log = OUT / "logs" / f"prefix-plan-{args.tag}.log"
    log.parent.mkdir(exist_ok=True)
    from sluice.engine.config import EngineConfig

    report: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": []}
    for name in args.workloads.split(","):
        lines = workload(name, args.gsm8k, args.lines, args.max_tokens)
        src = OUT / f"prefix-plan-{args.tag}-{name}.jsonl"
        src.write_text("".join(json.dumps({"custom_id": x["custom_id"], "method": "POST", "url": "/v1/chat/completions",
                                           "body": {k: v for k, v in x.items() if k != "custom_id"}}) + "\n"
                               for x in lines))
        mins = {w: minimum_computed(lines, w, EngineConfig.block_size) for w in (1, 2)}
        for system in args.systems.split(","):
            best: dict[str, Any] | None = None
            for _ in range(args.runs):
                out = OUT / f"prefix-plan-{args.tag}-{name}-{system}.out.jsonl"
                out.unlink(missing_ok=True)
                try:
                    if system in ("arrival", "planned"):
                        secs = run_generate(src, out, args, system == "planned", log)
                    elif system in ("arrival-2w", "planned-2w"):
                        secs = run_two_workers(lines, out, args, system == "planned-2w", log)
                    else:
                        secs = run_vllm(src, out, args, log)
                except (subprocess.CalledProcessError, OSError, ValueError) as e:  # exit 3: some lines failed
                    print(f"{name} {system}: failed ({e}); see {log}", file=sys.stderr)
                    break
                u = usage_of(out)
                row = {"workload": name, "system": system, "seconds": secs, **u,
                       "minimum": mins[2 if system.endswith("2w") else 1],
                       "tokens_per_s": (u["prompt"] + u["completion"]) / secs}
                if best is None or secs < best["seconds"]:
                    best = row
            if best is not None:
                report["rows"].append(best)
                print(json.dumps(best), flush=True)
    (OUT / f"prefix-plan-{args.tag}.json").write_text(json.dumps(report, indent=1))
    (OUT / f"prefix-plan-{args.tag}.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict[str, Any]) -> str:
    head = (f"{describe_cpu(report['machine'])}; {report['args']['dtype']}, {report['args']['lines']} lines x "
            f"{report['args']['max_tokens']} tokens, KV cache {report['args']['kv_cache_memory']}\n\n"
            "| workload | system | prompt tokens computed | / minimum | s | tokens/s | vs arrival |\n"
            "| --- | --- | --- | --- | --- | --- | --- |\n")
    rows = report["rows"]
    base = {(r["workload"], r["system"].removeprefix("planned").removeprefix("arrival")): r["tokens_per_s"]
            for r in rows if r["system"].startswith("arrival")}
    body = ""
    for r in rows:
        ref = base.get((r["workload"], r["system"].removeprefix("planned").removeprefix("arrival")))
        if r["system"] == "vllm":
            ref = base.get((r["workload"], ""))
        ratio = "" if ref is None else f"{r['tokens_per_s'] / ref:.2f}x"
        body += (f"| {r['workload']} | {r['system']} | {r['computed']:,} | {r['computed'] / r['minimum']:.2f}x | "
                 f"{r['seconds']:.1f} | {r['tokens_per_s']:.0f} | {ratio} |\n")
    return head + body


if __name__ == "__main__":
    main()
