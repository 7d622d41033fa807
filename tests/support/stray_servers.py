"""Finding the embedded job servers (valkey-server processes) a test run started and left running.

The run marks its environment (``RUN_MARK``); every process it starts inherits the mark, and so does a
server started by one of them (it is detached into its own session, so its parent says nothing)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

RUN_MARK = "PYTEST_SLUICE_RUN"  # not SLUICE_*: some tests pass sluice an environment without those


def stray_servers(run: str) -> list[tuple[int, str]]:
    """(pid, working directory) of the live valkey-server processes carrying ``RUN_MARK=run``."""
    mark = f"{RUN_MARK}={run}".encode()
    found = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            if p.joinpath("comm").read_text().strip() != "valkey-server":
                continue
            if mark not in p.joinpath("environ").read_bytes().split(b"\0"):
                continue
            if p.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found.append((int(p.name), os.readlink(p / "cwd")))
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


def kill(servers: list[tuple[int, str]]) -> None:
    for pid, _ in servers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
