"""Start-up: ``sluice generate`` of a one-line file, from spawning the process to its first result line.

Each run is a fresh process (``python -m sluice.cli.main generate ...`` on this checkout); the first finds
empty caches (its own SLUICE_HOME and SLUICE_MODEL_CACHE: the GGUF is dequantized, the GEMM and dtype
choices measured), the rest find what the first left (warm). The C++ ops come from the user's torch
extensions cache as ``scripts/install.sh`` leaves it (``--cold-ops``: a fresh one, so the first run
compiles them). Reported per run and as the median and spread of the warm runs, in seconds:

    interpreter   spawn -> the child's first line of Python
    cli import    import sluice.cli.main
    to engine     the command itself up to the engine's constructor (its imports: torch, transformers, ...)
    <engine>      the phases of the engine's "start-up in" log line (engine/startup_clock.py)
    first result  the engine built -> the first result line in the output file (tokenizing, prefill, decode)
    total         spawn -> first result line

    python bench/startup.py --runs 6            # default model, --dtype auto
    python bench/startup.py --runs 6 -- --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after site-packages: our kernels/ must not hide transformers' kernels

from sluice.engine.startup_clock import parse_line  # noqa: E402 - after the path: run as a script from anywhere

# The child: notes when its Python starts and when sluice.cli.main is imported, logs with wall-clock stamps
# (the CLI's basicConfig is then a no-op), and runs the command.
CHILD = """
import time, sys
t_start = time.time()
import logging
logging.basicConfig(level=logging.INFO, format="@%(created).4f %(levelname)s %(name)s: %(message)s")
import sluice.cli.main
print(f"@{t_start:.4f} STARTUP python", file=sys.stderr, flush=True)
print(f"@{time.time():.4f} STARTUP imported", file=sys.stderr, flush=True)
sys.argv[0] = "sluice"
cli.main.cli(sys.argv[1:])
"""
PROMPT = {"custom_id": "startup-0", "prompt": "Write one word.", "max_tokens": 4}


def run_once(work: Path, env: dict[str, str], extra: list[str], timeout: float) -> dict[str, Any]:
    """One fresh process: the phases in seconds, or an ``error``."""
    out = work / "out.jsonl"
    out.unlink(missing_ok=True)
    log = work / "stderr.log"
    cmd = [sys.executable, "-c", CHILD, "generate", str(work / "one.jsonl"), "-o", str(out), "--no-progress", *extra]
    t_spawn = time.time()
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    t_first = None
    while t_first is None and time.time() - t_spawn < timeout:
        if out.exists() and "\n" in out.read_text():
            t_first = time.time()
            break
        if proc.poll() is not None:
            break
        time.sleep(0.005)
    try:
        proc.wait(timeout=max(1.0, timeout - (time.time() - t_spawn)))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = log.read_text()
    if t_first is None:
        return {"error": f"no result line (exit {proc.returncode}): {text.strip().splitlines()[-1:] or ''}"}
    return phases(text, t_spawn, t_first)


def stamps(text: str) -> dict[str, float]:
    """The child's ``STARTUP`` marks and the stamp of the engine's start-up line."""
    out: dict[str, float] = {}
    for row in text.splitlines():
        if not row.startswith("@"):
            continue
        stamp, _, rest = row[1:].partition(" ")
        if rest.startswith("STARTUP "):
            out[rest.removeprefix("STARTUP ")] = float(stamp)
        elif "start-up in" in rest:
            out["engine"] = float(stamp)
    return out


def phases(text: str, t_spawn: float, t_first: float) -> dict[str, Any]:
    marks = stamps(text)
    row: dict[str, Any] = {"interpreter": marks["python"] - t_spawn, "cli import": marks["imported"] - marks["python"]}
    engine = parse_line(text)
    if engine is not None and "engine" in marks:
        total = engine.pop("total")
        row["to engine"] = marks["engine"] - total - marks["imported"]
        row.update(engine)
        row["first result"] = t_first - marks["engine"]
    else:  # an engine without the start-up line (before engine/startup_clock.py): the rest in one
        row["engine + first result"] = t_first - marks["imported"]
    row["total"] = t_first - t_spawn
    row["cache"] = cache_notes(text)
    return row


def cache_notes(text: str) -> str:
    """Which caches the run found, from the engine's log."""
    notes = []
    if "dequantizing" in text:
        notes.append("dequantized the GGUF")
    if "linear layers:" in text:
        notes.append("GEMM cached" if "measured earlier" in text.split("linear layers:", 1)[1].splitlines()[0]
                     else "GEMM measured")
    if "dtype auto:" in text:
        notes.append("dtype cached" if "measured earlier" in text.split("dtype auto:", 1)[1].splitlines()[0]
                     else "dtype measured")
    return ", ".join(notes)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """A table: each run, then the median and min-max of the warm runs (all but the first)."""
    names = [k for k in rows[0] if k != "cache"]
    for r in rows[1:]:
        names += [k for k in r if k not in names and k != "cache"]
    lines = ["| run | " + " | ".join(names) + " | caches |", "|" + " --- |" * (len(names) + 2)]
    for i, r in enumerate(rows):
        cells = [f"{r[k]:.2f}" if k in r else "" for k in names]
        lines.append(f"| {'cold' if i == 0 else f'warm {i}'} | " + " | ".join(cells) + f" | {r.get('cache', '')} |")
    warm = rows[1:]
    if warm:
        med = [statistics.median(r[k] for r in warm if k in r) if any(k in r for r in warm) else None for k in names]
        lo = [min((r[k] for r in warm if k in r), default=None) for k in names]
        hi = [max((r[k] for r in warm if k in r), default=None) for k in names]
        lines.append("| warm median | " + " | ".join("" if m is None else f"{m:.2f}" for m in med) + " | |")
        lines.append("| warm min-max | " + " | ".join("" if a is None else f"{a:.2f}-{b:.2f}"
                                                     for a, b in zip(lo, hi, strict=True)) + " | |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=6, help="fresh processes: the first cold, the rest warm")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    ap.add_argument("--user-caches", action="store_true",
                    help="use the user's SLUICE_HOME and model cache as they are (no cold first run)")
    ap.add_argument("--cold-ops", action="store_true", help="a fresh torch extensions cache: the first run compiles")
    ap.add_argument("--json", type=Path, default=None, help="also write the runs here")
    ap.add_argument("extra", nargs="*", help="more `sluice generate` options, after --")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sluice-startup-"))
    (work / "one.jsonl").write_text(json.dumps(PROMPT) + "\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if not args.user_caches:
        env.update(SLUICE_HOME=str(work / "home"), SLUICE_MODEL_CACHE=str(work / "dense"))
    if args.cold_ops:
        env["TORCH_EXTENSIONS_DIR"] = str(work / "torch_extensions")
    rows = []
    for i in range(args.runs):
        row = run_once(work, env, args.extra, args.timeout)
        if "error" in row:
            sys.exit(f"run {i}: {row['error']} (log: {work / 'stderr.log'})")
        rows.append(row)
        print(f"run {i}: {row['total']:.2f} s to the first result ({row['cache']})", file=sys.stderr, flush=True)
    print("\n".join(summary(rows)))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
