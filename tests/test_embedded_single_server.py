"""One job server per data directory (issue 40): a frozen embedded server (SIGSTOP: a stopped VM, heavy
swapping) is waited for, never doubled by a second server over the same files; only a server whose
process is gone is started again, once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sluice.jobs.connection import data_dir, ensure_server, find_server, stop_server

CHILD = """
import sys
from pathlib import Path
import redis
from sluice.jobs.connection import ensure_server
try:
    s = ensure_server(Path(sys.argv[1]), timeout=float(sys.argv[2]))
except redis.ConnectionError as e:
    print("refused:", e)
    sys.exit(3)
print("server", s.pid, s.port)
"""


def servers_of(home: Path) -> list[int]:
    """Pids of the valkey-server processes running in ``home``'s data directory."""
    want, out = data_dir(home), []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if b"valkey-server" in (proc / "cmdline").read_bytes() and (proc / "cwd").resolve(strict=True) == want:
                out.append(int(proc.name))
        except OSError:
            pass
    return out


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    h = tmp_path / "home"
    yield h
    for pid in servers_of(h):
        os.kill(pid, signal.SIGCONT)
    stop_server(h, kill=True)


def test_a_frozen_server_is_waited_for_never_doubled(home: Path) -> None:
    first = ensure_server(home)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        # Another process (a worker whose link lost the server) asks for the server while it is frozen.
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(home), "4"], stdout=subprocess.PIPE, text=True)
        seen: set[int] = set()
        while child.poll() is None:
            seen.update(servers_of(home))
            time.sleep(0.05)
        out = child.stdout.read() if child.stdout else ""
        assert child.returncode == 3 and "runs but has not answered" in out, out
        assert seen == {first.pid} and servers_of(home) == [first.pid]
        assert find_server(home) is None  # frozen: not answering
        # Thawed while another caller waits: that caller gets the same server.
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(home), "120"], stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out, _ = child.communicate(timeout=150)
    assert child.returncode == 0 and out.split() == ["server", str(first.pid), str(first.port)], out
    assert servers_of(home) == [first.pid]


def test_a_dead_server_is_started_again_once(home: Path) -> None:
    first = ensure_server(home)
    os.kill(first.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while first.pid in servers_of(home) and time.monotonic() < deadline:
        time.sleep(0.05)
    children = [subprocess.Popen([sys.executable, "-c", CHILD, str(home), "60"], stdout=subprocess.PIPE, text=True)
                for _ in range(3)]
    outs = [c.communicate(timeout=120)[0] for c in children]
    assert all(c.returncode == 0 for c in children), outs
    got = {tuple(o.split()[1:]) for o in outs}
    assert len(got) == 1, outs  # all three found the one server that one of them started
    pid, port = map(int, got.pop())
    assert pid != first.pid and port == first.port and servers_of(home) == [pid]
