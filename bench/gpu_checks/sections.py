"""The sections that run a child process (engine, graphs, end to end) and the model they share."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.gpu_checks.common import ROOT, Plan, Reporter
from bench.gpu_checks.graphs import graphs_rows
from bench.gpu_checks.models import build_model, make_workload


def run_child(side: str, args: argparse.Namespace, model_dir: Path, work_file: Path, timeout: float,
              rows: Reporter | None = None) -> dict[str, Any]:
    """Run one side in a fresh process, its output echoed as it comes; the last RESULT, or the last PROGRESS
    if the time limit hit. Rows the child makes (ROWJ lines) go into ``rows`` as they arrive."""
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--child", side, "--model-dir", str(model_dir), "--workload", str(work_file)]
    if args.dry_run:
        cmd.append("--dry-run")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    last: dict[str, Any] = {}
    tail: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, _, payload = line.rstrip("\n").partition(" ")
            if kind in ("RESULT", "PROGRESS"):
                last.clear()
                last.update(kind=kind, **json.loads(payload))
            elif kind == "ROWJ" and rows is not None:
                made = json.loads(payload)
                rows.append(tuple(made["row"]), **made["data"])  # type: ignore[arg-type]
            else:
                print(f"  [{side}] {line}", end="", flush=True)
                tail[:] = [*tail[-40:], line]

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status = "ok" if proc.wait(timeout=max(timeout, 10)) == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = f"cut off at {timeout:.0f}s"
    reader.join(timeout=10)
    if status == "ok" and last.get("kind") != "RESULT":
        status = "no result"
    if status != "ok":
        print(f"--- {side}: {status}; output tail ---\n{''.join(tail[-20:])}", flush=True)
    result = dict(last)
    result["status"] = status
    return result


def _agreement(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How often the two sides' first tokens agree: bf16 rounding on random weights makes near-ties, so
    a few divergences are expected; wholesale disagreement is a bug."""
    ha, hb = a.get("heads", {}), b.get("heads", {})
    common = [k for k in ha if k in hb]
    if not common:
        return "no common requests"
    first = sum(ha[k][:1] == hb[k][:1] for k in common) / len(common)
    all16 = sum(ha[k] == hb[k] for k in common) / len(common)
    return f"first token equal in {first:.0%}, first 16 in {all16:.0%} of {len(common)}"


@dataclass
class Prepared:
    """The random-weight model and the workload that the engine, graphs and end-to-end sections share."""

    model_dir: Path
    work_file: Path
    work: list[tuple[list[int], int]]


def prepare_model(plan: Plan, rng: random.Random, rows: Reporter) -> Prepared:
    tmp = Path(tempfile.mkdtemp(prefix="sluice-gpu-check-"))
    model_dir, tokenizer = build_model(plan, tmp / "model", rng.randrange(2**31))
    rows.append(("setup", "model", tokenizer, f"random {plan.model_dtype} weights, {plan.model['num_hidden_layers']} layers"))
    work = make_workload(plan, rng)
    work_file = tmp / "workload.json"
    work_file.write_text(json.dumps(work))
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    rows.append(("setup", "workload", f"{len(work)} requests", f"{prompt_tokens} prompt + {output_tokens} output tokens"),
                requests=len(work), prompt_tokens=prompt_tokens, output_tokens=output_tokens)
    return Prepared(model_dir, work_file, work)


def engine_section(plan: Plan, args: argparse.Namespace, prep: Prepared, deadline: float, rows: Reporter) -> bool:
    """The engine child's checks; True when every one passed."""
    before = len(rows.rows)
    limit = min(plan.engine_budget_s, 0.5 * (deadline - time.monotonic()))
    res = run_child("engine", args, prep.model_dir, prep.work_file, limit, rows)
    made = rows.rows[before:]
    if res["status"] != "ok":
        rows.append(("engine", "child", "INCOMPLETE", f"{res['status']} after {len(made)} rows"))
        return False
    return bool(made) and all(r[2] in ("PASS", "INFO") for r in made)


def graphs_section(plan: Plan, args: argparse.Namespace, prep: Prepared, deadline: float, rows: Reporter) -> None:
    limit = min(plan.graph_budget_s, 0.4 * (deadline - time.monotonic()))
    graphs_rows(run_child("graphs", args, prep.model_dir, prep.work_file, limit), rows)


def end_to_end(plan: Plan, args: argparse.Namespace, prep: Prepared, deadline: float, rows: Reporter) -> None:
    results = {}
    n = len(prep.work)
    for side, share in (("ours", 0.5), ("transformers", 1.0)):
        left = deadline - time.monotonic()
        results[side] = res = run_child(side, args, prep.model_dir, prep.work_file, left * share)
        wall = res.get("wall_s") or res.get("elapsed_s") or float("nan")
        toks = res.get("output_tokens", 0)
        counted = "tokens of every request" if side == "ours" or res["status"] == "ok" else "finished requests' tokens only"
        rows.append((
            "end-to-end",
            side,
            f"{toks / wall:.0f} output tok/s" if toks else "no tokens",
            f"{res['status']}: {res.get('done', 0)}/{n} requests in {wall:.1f}s ({counted}), load {res.get('load_s', 0):.0f}s, "
            f"errors {res.get('errors', '?')}",
        ), status=res["status"], output_tokens=toks, wall_s=wall, done=res.get("done", 0))  # fmt: skip
    a, b = results["ours"], results["transformers"]
    if not (a.get("output_tokens") and b.get("output_tokens")):
        rows.append(("end-to-end", "speed-up", "n/a", "a side generated nothing"))
        return
    speed = (a["output_tokens"] / (a.get("wall_s") or a["elapsed_s"])) / (
        b["output_tokens"] / (b.get("wall_s") or b["elapsed_s"])
    )
    if b["status"] != "ok":  # its finished-only count understates it: the ratio is an upper bound
        result, note = f"at most {speed:.2f}x", "transformers cut off: only its finished requests counted"
    elif a["status"] != "ok":
        result, note = f"{speed:.2f}x", "ours cut off: its rate over the tokens generated so far"
    else:
        result, note = f"{speed:.2f}x", "both sides finished every request"
    rows.append(("end-to-end", "speed-up", result, f"{note}; {_agreement(a, b)}"), speed_up=speed,
                both_finished=a["status"] == b["status"] == "ok")
