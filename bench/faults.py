"""A worker process with faults injected, for the chaos run (bench/chaos.py) and the reliability tests:

    python bench/faults.py <the arguments of python -m sluice.worker>

The faults are patched in here, never shipped in the packages; each is off unless its variable is set:

    CHAOS_BREAK_ON=TEXT     a request whose prompt contains TEXT breaks the engine when a step runs it, as
                            a CUDA device-side assert does: that step and every later one fail, whatever
                            they run (a probe request too), until the process exits.
    CHAOS_FAIL_ON=TEXT      with CHAOS_FAIL_WHILE=PATH: while the file PATH exists, a step that runs a request
                            whose prompt contains TEXT raises (the engine stays healthy: the probe passes), as
                            a request an operator can fix (a missing adapter or grammar) does; each failure
                            is logged with its time ("chaos: failing ... at T").
    CHAOS_SLOW_DISK=PATH    while the file PATH exists, each write of a results chunk (jobs/spill.py)
                            stalls until PATH is removed (at most SLOW_DISK_MAX seconds): a dying disk.
                            The stalled process creates PATH.held.<pid> meanwhile, so a caller can see it.
    CHAOS_SPILL_KEEP=N      results left in the stream when moving them to files (sluice.jobs.spill.KEEP), so a
                            small batch spills (with SLUICE_RESULTS_SPILL).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after site-packages: our kernels/ must not hide transformers' kernels

log = logging.getLogger("chaos.faults")

SLOW_DISK_MAX = 300.0


class DeviceAssert(RuntimeError):
    """What a CUDA device-side assert looks like from Python: the context is unusable from then on."""


def break_engine_on(marker: str) -> None:
    from sluice.engine.llm import LLM

    real_step = LLM.step
    broken: list[str] = []  # the request that broke this process's engine, once one has

    def step(self: LLM) -> Any:
        if not broken:
            broken.extend([rid for rid, s in self.requests.items() if marker in (s.request.prompt or "")][:1])
            if broken:
                log.error("chaos: request %s breaks the engine (an injected device-side assert)", broken[0])
        if broken:
            raise DeviceAssert(f"CUDA error: device-side assert triggered (injected: {marker!r} broke the engine)")
        return real_step(self)

    LLM.step = step  # type: ignore[method-assign]


def fail_while(marker: str, flag: Path) -> None:
    from sluice.engine.llm import LLM

    real_step = LLM.step

    def step(self: LLM) -> Any:
        hit = [rid for rid, s in self.requests.items() if marker in (s.request.prompt or "")]
        if hit and flag.exists():
            log.error("chaos: failing %s at %.3f", hit[0], time.time())
            raise RuntimeError(f"injected: {marker!r} cannot run while {flag.name} exists")
        return real_step(self)

    LLM.step = step  # type: ignore[method-assign]


def slow_disk(flag: Path) -> None:
    from sluice.jobs import spill

    real_write = spill._write

    def write(path: Path, entries: list[tuple[str, dict[str, str]]], token: str) -> None:
        if flag.exists():
            held = flag.with_name(f"{flag.name}.held.{os.getpid()}")
            held.touch()
            log.warning("chaos: the results disk stalls (writing %s)", path.name)
            deadline = time.monotonic() + SLOW_DISK_MAX
            while flag.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            held.unlink(missing_ok=True)
            log.warning("chaos: the results disk is back")
        real_write(path, entries, token)

    spill._write = write


def main() -> None:
    if marker := os.environ.get("CHAOS_BREAK_ON"):
        break_engine_on(marker)
    if (marker := os.environ.get("CHAOS_FAIL_ON")) and (flag := os.environ.get("CHAOS_FAIL_WHILE")):
        fail_while(marker, Path(flag))
    if flag := os.environ.get("CHAOS_SLOW_DISK"):
        slow_disk(Path(flag))
    if keep := os.environ.get("CHAOS_SPILL_KEEP"):
        from sluice.jobs import spill

        spill.KEEP = int(keep)
    from sluice.worker.__main__ import main as worker_main

    worker_main(sys.argv[1:])


if __name__ == "__main__":
    main()
