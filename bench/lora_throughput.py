"""LoRA throughput: the chat workload (160 prompts x 256 tokens) with its lines spread over 1, 4 and 16
adapters (rank 16, every q/k/v/o/gate/up/down), against the base model alone, on the default model.

    python bench/lora_throughput.py                                    # float32, base + 1, 4, 16 adapters, 3 rounds
    python bench/lora_throughput.py --adapters 0,4 --max-tokens 128 --tag lora-4      # the target's check: base, 4, x3
    python bench/lora_throughput.py --num-prompts 16 --max-tokens 16 --rounds 1 --tag lora-smoke   # a quick smoke run
    python bench/lora_throughput.py --dtype bfloat16 --adapters 0,4
    python bench/lora_throughput.py --vllm                             # and vLLM's CPU build, same adapters

Each configuration runs in a fresh process of its own (this script, ``--child``), greedy, with EOS
ignored so that every run generates exactly num_prompts x max_tokens tokens (random adapters change when
EOS comes, and the comparison is of rates at equal work). Line i runs on adapter i mod K; ``max_loras``
is K, so all K are resident and any step may mix them. The adapters are random (both halves; B drawn
small, so the outputs stay text-like), made with peft once and kept in bench/out/lora-adapters/.
The configurations take turns for ``--rounds`` rounds (base, 4, base, 4, ...): the machine's speed drifts
(the base alone read 537-614 tok/s within 20 minutes), so one base run against one adapter run tells
little; each round's ratio is to the base run beside it, and the median over the rounds is the result.
Prints tokens/s and the ratios; writes bench/out/TAG.json and TAG.md. The issue's target: 4 adapters
at >= 0.8x of the base alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "out"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
sys.path.insert(0, str(HERE))
import workloads  # noqa: E402  (bench/workloads.py, beside this file)


def make_adapters(model_dir: str, root: Path, count: int, rank: int) -> dict[str, str]:
    """``count`` random rank-``rank`` adapters of the model at ``model_dir`` (made once, then reused)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i in range(count):
        path = root / f"r{rank}-{i}"
        if not (path / "adapter_model.safetensors").exists():
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
            model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
            gen = torch.Generator().manual_seed(i)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:  # peft leaves B at zero: the adapter would change nothing
                        p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
            model.save_pretrained(path)
        out[f"a{i}"] = str(path)
    return out


def child(args: argparse.Namespace) -> None:
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

    w = json.loads(args.workload.read_text())
    adapters = dict(list(w["adapters"].items())[: args.child_adapters])
    kw: dict[str, Any] = {"dtype": args.dtype, "max_num_seqs": args.max_num_seqs, "kv_cache_memory": args.kv_cache_memory}
    if adapters:
        kw.update(lora_modules=adapters, max_loras=len(adapters), max_lora_rank=w["rank"])
    llm = LLM(w["model"], **kw)
    names = list(adapters) or [None]
    ids, max_tokens = w["prompt_token_ids"], w["max_tokens"]

    def requests(prefix: str, prompts: list[list[int]], n: int) -> list[Request]:
        return [Request(f"{prefix}{i}", prompt_token_ids=p, lora=names[i % len(names)],
                        params=SamplingParams(max_tokens=n, ignore_eos=True)) for i, p in enumerate(prompts)]

    llm.generate(requests("warm", [x[:8] for x in ids[: len(names)]], 4))  # every adapter loaded, off the clock
    t = time.perf_counter()
    out = llm.generate(requests("b", ids, max_tokens))
    secs = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for c in out)
    errors = [c.error for c in out if c.error]
    result = {"adapters": len(adapters), "seconds": secs, "output_tokens": tokens, "tokens_per_s": tokens / secs,
              "errors": errors[:3], "stats": llm.stats}
    args.result.write_text(json.dumps(result))
    print(f"{len(adapters)} adapters: {tokens / secs:.1f} tok/s ({tokens} tokens, {secs:.1f}s)", flush=True)


def run_child(args: argparse.Namespace, workload: Path, k: int, system: str = "sluice", round_: int = 1) -> dict[str, Any]:
    """One configuration in a fresh process: Sluice (this script) or vLLM (bench/vllm_lora_run.py, its venv)."""
    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    name = f"{args.tag}-{system}-{k}-round{round_}"
    log, result = logs / f"{name}.log", OUT / "tmp" / f"{name}.json"
    result.parent.mkdir(exist_ok=True)
    result.unlink(missing_ok=True)
    common = ["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", str(args.kv_cache_memory)]
    if system == "vllm":
        import throughput  # bench/throughput.py: vLLM's venv and environment, as its own runs use them

        why = throughput.ensure_vllm(args.vllm_venv, logs / "vllm_env.log")
        if why:
            return {"system": system, "adapters": k, "error": why}
        cmd = [str(args.vllm_venv / "bin" / "python"), str(HERE / "vllm_lora_run.py"), str(workload), str(result),
               "--adapters", str(k), *common]
        env = throughput.vllm_env(args.vllm_venv)
    else:
        cmd = [sys.executable, __file__, "--child-adapters", str(k), "--workload", str(workload), "--result",
               str(result), *common]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not result.exists():
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        return {"system": system, "adapters": k, "error": f"exit {rc}; log {log}: {tail}"}
    return {"system": system, **json.loads(result.read_text())}


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Each round's table (each ratio to its system's base-alone run of the same round), then per adapter
    count every round's ratio and their median: the machine's drift moves a round's base and adapter runs
    alike, so the median ratio is the number to quote, not one run's."""
    lines = [f"LoRA throughput: {args.num_prompts} prompts x {args.max_tokens} tokens (chat workload, EOS ignored), "
             f"rank {args.rank}, {args.dtype}, max_num_seqs {args.max_num_seqs}, {args.rounds} round(s)", "",
             "| round | system | lines over | tokens/s | vs its base alone, same round |", "|---:|---|---|---:|---:|"]
    ratios: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        what = "base alone" if r["adapters"] == 0 else f"{r['adapters']} adapter{'s' if r['adapters'] > 1 else ''}"
        if "error" in r:
            lines.append(f"| {r['round']} | {r['system']} | {what} | failed: {r['error']} | |")
            continue
        b = _base(rows, r)
        ratio = "-"
        if b and r["adapters"]:
            ratios.setdefault((r["system"], r["adapters"]), []).append(r["tokens_per_s"] / b)
            ratio = f"{r['tokens_per_s'] / b:.2f}x"
        lines.append(f"| {r['round']} | {r['system']} | {what} | {r['tokens_per_s']:.1f} | {ratio} |")
    lines += ["", "| system | lines over | ratio per round | median ratio |", "|---|---|---|---:|"]
    for (system, k), rs in ratios.items():
        lines.append(f"| {system} | {k} adapter{'s' if k > 1 else ''} | {', '.join(f'{x:.2f}x' for x in rs)} | "
                     f"{statistics.median(rs):.2f}x |")
    return "\n".join(lines) + "\n"


def _base(rows: list[dict[str, Any]], row: dict[str, Any]) -> float | None:
    """The tokens/s of ``row``'s system alone (no adapter) in ``row``'s round."""
    for r in rows:
        if r["round"] == row["round"] and r["system"] == row["system"] and r["adapters"] == 0:
            return r.get("tokens_per_s")
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="as for sluice --model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-prompts", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--adapters", default="0,1,4,16", help="the adapter counts to run (0 = the base alone)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="bytes")
    p.add_argument("--rounds", type=int, default=3,
                   help="run every configuration this many times, taking turns (base, 4, base, 4, ...); the "
                        "median of the rounds' ratios is the result")
    p.add_argument("--tag", default="lora-throughput")
    p.add_argument("--vllm", action="store_true", help="also vLLM's CPU build (its LoRA support) on the same adapters")
    p.add_argument("--vllm-venv", type=Path, default=Path(os.environ.get("VLLM_VENV", HERE / ".vllm-venv")))
    # One configuration's run (what the parent starts in a fresh process):
    p.add_argument("--child-adapters", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_adapters is not None:
        child(args)
        return
    counts = [int(x) for x in args.adapters.split(",")]
    from sluice.engine.loader import dense_path, load_tokenizer, resolve_model

    model_dir = dense_path(resolve_model(args.model))
    adapters = make_adapters(model_dir, OUT / "lora-adapters", max(counts), args.rank)
    ids = workloads.build("chat", load_tokenizer(args.model), args.num_prompts)
    workload = OUT / "tmp" / f"{args.tag}-workload.json"
    workload.parent.mkdir(parents=True, exist_ok=True)
    workload.write_text(json.dumps({"model": args.model, "model_dir": model_dir, "prompt_token_ids": ids,
                                    "max_tokens": args.max_tokens, "adapters": adapters, "rank": args.rank}))
    systems = ["sluice", "vllm"] if args.vllm else ["sluice"]
    rows = []
    for i in range(1, args.rounds + 1):  # base and adapters take turns, round after round (see markdown)
        for system in systems:
            for k in counts:
                row = {"round": i, **run_child(args, workload, k, system, i)}
                rows.append(row)
                got = f"{row['tokens_per_s']:.1f} tok/s" if "tokens_per_s" in row else row["error"]
                print(f"round {i}, {system}, {k} adapters: {got}", flush=True)
    (OUT / f"{args.tag}.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))
    table = markdown(rows, args)
    (OUT / f"{args.tag}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
