"""Embedding throughput on one machine: Sluice's EmbeddingEngine against sentence-transformers' ``encode``
(and vLLM's CPU build where its venv can be had), on all-MiniLM-L6-v2 from the PyPI wheel.

    python bench/embed_throughput.py                       # 5,000 passages; sluice, st-32, st-best, vllm
    python bench/embed_throughput.py --systems sluice,vllm --rounds 3 --num-passages 2500   # Sluice vs vLLM
    python bench/embed_throughput.py --num-passages 500 --systems sluice,st-32 --tag quick

The workload: ``--num-passages`` passages of mixed length (a third short, a third medium, a third past
the model's 256 tokens, which every system truncates the same way), made of real text from
../shared/data: the MT-Bench and Vicuna prompts' turns and the Compose specification's descriptions,
sentences drawn with a fixed seed. Every system runs in a fresh process of its own on the same texts,
after a warm-up on 64 of them; float32; all the cores the process may use. ``st-best`` runs encode at
each of ``--st-batch-sizes`` and keeps the fastest. Texts/s counts passages; tokens/s counts the tokens
embedded (after truncation), the same for every system. The vectors of each system are compared with
Sluice's (cosine). The load average before and after each run is recorded: numbers taken while other
work shares the machine are not final.

``--rounds N`` runs the whole list of systems N times, alternately (sluice, vllm, sluice, vllm, ...; each
run its own process, the same passages), and reports every round's ratio of Sluice to each other system
and the median over rounds: a machine whose speed drifts over minutes (a neighbour's load, thermal or
frequency changes) then moves both sides of a ratio alike instead of deciding it.
Writes bench/out/TAG.json and TAG.md; each child's log goes to bench/out/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = ROOT.parent / "shared" / "data"
OUT = HERE / "out"
SYSTEMS = ("sluice", "st-32", "st-best", "vllm")
MODEL = "all-MiniLM-L6-v2"
WARMUP = 64


# ---- the workload ------------------------------------------------------------------------------
def sentences() -> list[str]:
    """Real sentences: prompt turns and the Compose spec's descriptions, split at sentence ends."""
    texts: list[str] = []
    for name in ("mt_bench.jsonl", "vicuna_bench.jsonl"):
        f = DATA / "prompts" / name
        if not f.exists():
            raise SystemExit(f"{f} not found: the benchmark reads the shared data beside the project")
        texts += [t for line in f.read_text().splitlines() if line.strip() for t in json.loads(line)["turns"]]
    spec = json.loads((DATA / "compose" / "compose-spec.json").read_text())
    texts += list(_descriptions(spec))
    return [s.strip() for t in texts for s in re.split(r"(?<=[.?!])\s+|\n+", t) if len(s.strip()) > 3]


def _descriptions(x: Any) -> Any:
    if isinstance(x, dict):
        for k, v in x.items():
            if k == "description" and isinstance(v, str):
                yield v
            else:
                yield from _descriptions(v)
    elif isinstance(x, list):
        for v in x:
            yield from _descriptions(v)


def passages(n: int, seed: int = 0) -> list[str]:
    """``n`` passages: a third of 1-2 sentences, a third of 3-10, a third of 15-40 (past 256 tokens)."""
    rng = random.Random(seed)
    pool = sentences()
    out = []
    for i in range(n):
        k = rng.randint(*((1, 2), (3, 10), (15, 40))[i % 3])
        start = rng.randrange(len(pool))
        out.append(" ".join(pool[(start + j) % len(pool)] for j in range(k)))
    rng.shuffle(out)
    return out


# ---- the children (each in its own process) ---------------------------------------------------
def tree_cpu_seconds() -> float:
    """CPU seconds (user + system, all threads) of this process and its descendants so far: vLLM runs its
    engine in a child process. On a machine others load too, work per CPU-second moves far less than
    wall-clock rates do."""
    parent, cpu = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parent[pid], cpu[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    me, total = os.getpid(), 0
    for pid, ticks in cpu.items():
        p = pid
        while p in parent and p != me:
            p = parent[p]
        if p == me:
            total += ticks
    return total / os.sysconf("SC_CLK_TCK")


def timed(fn: Any) -> tuple[Any, float, float]:
    """``fn()``, its wall seconds and its CPU seconds."""
    c0, t0 = tree_cpu_seconds(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, tree_cpu_seconds() - c0
def child_sluice(texts: list[str], model_dir: str, args: argparse.Namespace) -> tuple[list[list[float]], dict[str, Any]]:
    from sluice.engine.omp_spin import short_omp_spin

    spin = short_omp_spin()  # before torch loads, as `sluice worker` / `sluice generate` do for an embedding model
    from sluice.engine.embedding_engine import EmbeddingEngine, EmbeddingRequest

    budget = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    eng = EmbeddingEngine(model_dir, max_num_seqs=args.max_num_seqs, **budget)
    eng.embed([EmbeddingRequest(f"w{i}", t) for i, t in enumerate(texts[:WARMUP])])
    outs, secs, cpu = timed(lambda: eng.embed([EmbeddingRequest(str(i), t) for i, t in enumerate(texts)]))
    s = eng.stats
    return [o.embeddings[0] for o in outs], {"seconds": secs, "cpu_seconds": cpu, "steps": s["steps"], "padding_share": s["padding_share"],
                                             "settings": f"max_num_batched_tokens {eng.config.max_num_batched_tokens}, "
                                                         f"max_num_seqs {args.max_num_seqs}, "
                                                         f"{eng.model.attention} attention, GOMP_SPINCOUNT "
                                                         f"{os.environ.get('GOMP_SPINCOUNT', 'unset')}"
                                                         f"{'' if spin else ' (as given)'}"}


def child_st(texts: list[str], model_dir: str, batch_sizes: list[int]) -> tuple[list[list[float]], dict[str, Any]]:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(model_dir, device="cpu")
    st.encode(texts[:WARMUP], batch_size=32)
    best: dict[str, Any] = {}
    runs = {}
    for bs in batch_sizes:
        vecs, secs, cpu = timed(lambda bs=bs: st.encode(texts, batch_size=bs, convert_to_numpy=True))
        runs[bs] = round(secs, 2)
        if not best or secs < best["seconds"]:
            best = {"seconds": secs, "cpu_seconds": cpu, "batch_size": bs, "vectors": vecs}
    return best.pop("vectors").tolist(), {**best, "settings": f"batch_size {best['batch_size']}",
                                          "seconds_by_batch_size": runs}


def child_vllm(texts: list[str], model_dir: str) -> tuple[list[list[float]], dict[str, Any]]:
    import vllm
    from vllm import LLM

    # A stated KV budget: without one vLLM's CPU build reserves 92% of all memory and refuses to start
    # where other processes hold some (an encoder-only model needs no KV cache at all).
    llm = LLM(model=model_dir, runner="pooling", dtype="float32", seed=0, max_model_len=256,
              kv_cache_memory_bytes=1 << 30)
    cut = {"truncation": True, "max_length": 256}  # vLLM refuses a longer input unless told to cut it
    llm.embed(texts[:WARMUP], use_tqdm=False, tokenization_kwargs=cut)
    outs, secs, cpu = timed(lambda: llm.embed(texts, use_tqdm=False, tokenization_kwargs=cut))
    return [list(o.outputs.embedding) for o in outs], {"seconds": secs, "cpu_seconds": cpu,
                                                        "settings": f"vllm {vllm.__version__}"}


def run_child(args: argparse.Namespace) -> None:
    w = json.loads(Path(args.workload).read_text())
    if args.child == "sluice":
        vecs, info = child_sluice(w["texts"], w["model_dir"], args)
    elif args.child == "vllm":
        vecs, info = child_vllm(w["texts"], w["model_dir"])
    else:
        sizes = [32] if args.child == "st-32" else [int(x) for x in args.st_batch_sizes.split(",")]
        vecs, info = child_st(w["texts"], w["model_dir"], sizes)
    Path(args.result).write_text(json.dumps({"info": info, "vectors": vecs}))


# ---- the parent ---------------------------------------------------------------------------------
def run_system(system: str, args: argparse.Namespace, workload: Path, rnd: int) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    import throughput  # bench/throughput.py: the vLLM venv and its environment

    logs = OUT / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    name = f"{args.tag}-{system}" + (f"-r{rnd}" if args.rounds > 1 else "")
    log, result = logs / f"{name}.log", OUT / "tmp" / f"{name}.json"
    result.parent.mkdir(exist_ok=True)
    result.unlink(missing_ok=True)
    py, env = sys.executable, dict(os.environ, PYTHONPATH=str(ROOT))
    if system == "vllm":
        why = throughput.ensure_vllm(args.vllm_venv, logs / "vllm_env.log")
        if why:
            return {"system": system, "round": rnd, "error": why}
        py, env = str(args.vllm_venv / "bin" / "python"), throughput.vllm_env(args.vllm_venv)
    budget = [] if args.max_num_batched_tokens is None else ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd = [py, str(Path(__file__).resolve()), "--child", system, "--workload", str(workload), "--result", str(result),
           *budget, "--max-num-seqs", str(args.max_num_seqs), "--st-batch-sizes", args.st_batch_sizes]
    load_before = os.getloadavg()
    t = time.time()
    with log.open("w") as f:
        try:
            rc: Any = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                     timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc != 0 or not result.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        return {"system": system, "round": rnd,
                "error": f"exit {rc} after {time.time() - t:.0f}s; log {log}: " + " | ".join(tail)}
    import torch

    r = json.loads(result.read_text())
    result.unlink()
    return {"system": system, "round": rnd, **r["info"], "vectors": torch.tensor(r["vectors"], dtype=torch.float64),
            "process_seconds": time.time() - t, "load_before": load_before, "load_after": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-passages", type=int, default=5000)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=1, help="run the systems this many times, alternately")
    ap.add_argument("--st-batch-sizes", default="16,64,128,256", help="st-best: encode's batch sizes to try")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="sluice: the token budget of a pass (default: EmbeddingConfig's)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--vllm-venv", type=Path, default=HERE / ".vllm-venv")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--tag", default="embed")
    ap.add_argument("--child", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        run_child(args)
        return
    systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in systems if s not in SYSTEMS]
    if bad:
        raise SystemExit(f"unknown system(s) {bad}; choose from {SYSTEMS}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")

    sys.path.append(str(ROOT))  # after site-packages: our kernels/ must not hide transformers' kernels
    from sluice.engine.embedding_model import minilm_dir
    from transformers import AutoTokenizer

    model_dir = str(minilm_dir())
    texts = passages(args.num_passages)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tokens = sum(len(x) for x in tok(texts, truncation=True, max_length=256)["input_ids"])
    OUT.mkdir(exist_ok=True)
    workload = OUT / "tmp" / f"{args.tag}-workload.json"
    workload.parent.mkdir(exist_ok=True)
    workload.write_text(json.dumps({"model_dir": model_dir, "texts": texts}))
    print(f"{len(texts)} passages, {tokens} tokens embedded (after truncation to 256), model {model_dir}", flush=True)
    started = time.time()
    results = []
    for rnd in range(1, args.rounds + 1):
        for s in systems:
            r = run_system(s, args, workload, rnd)
            if "error" not in r:
                r["texts_per_s"] = len(texts) / r["seconds"]
                r["tokens_per_s"] = tokens / r["seconds"]
                r["tokens_per_cpu_s"] = tokens / r["cpu_seconds"]
            results.append(r)
            print(f"  {line(r)}", flush=True)
    agreement(results)
    report(args, results, len(texts), tokens, time.time() - started)


def line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"round {r['round']} {r['system']:8s} could not run: {r['error']}"
    return (f"round {r['round']} {r['system']:8s} {r['texts_per_s']:8.1f} texts/s {r['tokens_per_s']:9.0f} tokens/s "
            f"{r['tokens_per_cpu_s']:8.0f} tokens/CPU-s ({r['seconds']:.1f} s, {r['process_seconds']:.0f} s with start-up; "
            f"{r['settings']}; "
            f"load {r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f})")


def agreement(results: list[dict[str, Any]]) -> None:
    """Each run's vectors against the first Sluice run's: the smallest cosine over all passages."""
    import torch

    ref = next((r["vectors"] for r in results if r["system"] == "sluice" and "vectors" in r), None)
    for r in results:
        vecs = r.pop("vectors", None)
        if ref is not None and vecs is not None:
            r["min_cosine_vs_sluice"] = torch.nn.functional.cosine_similarity(vecs, ref, dim=-1).min().item()


def round_ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per other system: Sluice's tokens/s over its tokens/s in each round where both ran, and the median."""
    by_round: dict[int, dict[str, float]] = {}
    for r in results:
        if "error" not in r:
            by_round.setdefault(r["round"], {})[r["system"]] = r["tokens_per_s"]
    out: dict[str, dict[str, Any]] = {}
    for rnd, rates in sorted(by_round.items()):
        for system, rate in rates.items():
            if system != "sluice" and "sluice" in rates:
                out.setdefault(system, {"rounds": {}})["rounds"][rnd] = rates["sluice"] / rate
    for v in out.values():
        v["median"] = statistics.median(v["rounds"].values())
    return out


def report(args: argparse.Namespace, results: list[dict[str, Any]], n: int, tokens: int, seconds: float) -> None:
    sys.path.insert(0, str(HERE))
    import throughput

    m = throughput.machine()
    ok = [r for r in results if "error" not in r]
    rows = ["| round | system | texts/s | tokens/s | vs sentence-transformers (best) | tokens per CPU-second | "
            "min cosine vs Sluice | settings | load avg before -> after |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['round']} | {r['system']} | - | - | - | - | - | could not run: {r['error'][:200]} | |")
            continue
        same = {x["system"]: x for x in ok if x["round"] == r["round"]}
        base = same.get("st-best") or same.get("st-32")
        ratio = f"{r['texts_per_s'] / base['texts_per_s']:.2f}x" if base else "-"
        cos = f"{r['min_cosine_vs_sluice']:.7f}" if "min_cosine_vs_sluice" in r else "-"
        rows.append(f"| {r['round']} | {r['system']} | {r['texts_per_s']:.1f} | {r['tokens_per_s']:.0f} | {ratio} | "
                    f"{r['tokens_per_cpu_s']:.0f} | {cos} | {r['settings']} | "
                    f"{r['load_before'][0]:.2f} -> {r['load_after'][0]:.2f} |")
    ratios = round_ratios(results)
    if ratios:
        rows += ["", "| Sluice / system (tokens/s) | " + " | ".join(f"round {i}" for i in range(1, args.rounds + 1)) +
                 " | median |", "| --- |" + " ---: |" * (args.rounds + 1)]
        for system, v in ratios.items():
            cells = [f"{v['rounds'][i]:.2f}x" if i in v["rounds"] else "-" for i in range(1, args.rounds + 1)]
            rows.append(f"| {system} | " + " | ".join(cells) + f" | {v['median']:.2f}x |")
    head = (f"{n} passages ({tokens} tokens after truncation to 256), {MODEL} float32, "
            f"{throughput.describe_cpu(m)}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"{args.rounds} round(s), {seconds / 60:.1f} min in all")
    md = head + "\n\n" + "\n".join(rows) + "\n"
    (OUT / f"{args.tag}.md").write_text(md)
    (OUT / f"{args.tag}.json").write_text(json.dumps({"machine": m, "passages": n, "tokens": tokens, "rounds": args.rounds,
                                                      "seconds": seconds, "results": results,
                                                      "ratios": {k: {"rounds": {str(i): x for i, x in v["rounds"].items()},
                                                                     "median": v["median"]} for k, v in ratios.items()}},
                                                     indent=1))
    print("\n" + md + f"\nwritten: {OUT / (args.tag + '.md')}, {OUT / (args.tag + '.json')}")


if __name__ == "__main__":
    main()
