"""One job server per data directory (issue 40): a frozen embedded server (SIGSTOP: a stopped VM, heavy
swapping) is waited for, never doubled by a second server over the same files; only a server whose
process is gone is started again, once."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
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


def test_the_api_follows_a_server_restarted_on_another_port(home: Path, tmp_path: Path) -> None:
    """The embedded server dies and its port is taken, so whoever restarts it (here this test, as a worker
    would) gets another port: a running ``sluice serve`` follows it, as the workers do (it kept the old
    URL: 503 for good, while the workers wrote to the new server)."""
    import httpx
    import redis
    from cli_api_helpers import start_sluice, stop, wait_for_url
    from sluice.jobs.connection import connect
    from sluice.jobs.store import get_batch

    first = ensure_server(home)
    log = tmp_path / "serve.log"
    env = {**os.environ, "SLUICE_HOME": str(home), "SLUICE_FILES_DIR": str(tmp_path / "files")}
    env.pop("SLUICE_REDIS_URL", None)
    api = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log, env=env)
    try:
        url = wait_for_url(api, log, timeout=60)
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/v1/batches").status_code == 200, log.read_text()[-3000:]
            with _squat(home, first.pid, first.port):  # the old port is someone else's now
                second = ensure_server(home)
                assert second.port != first.port
                job = http.post("/v1/jobs", json={"prompt": "hello", "max_tokens": 2})
            assert job.status_code == 200, (job.text, log.read_text()[-3000:])
            r: redis.Redis = connect(second.url)
            try:
                assert get_batch(r, job.json()["id"]) is not None  # queued on the server the workers use
            finally:
                r.close()
    finally:
        assert stop(api) == 0, log.read_text()[-3000:]


@contextmanager
def _squat(home: Path, pid: int, port: int) -> Iterator[socket.socket]:
    """Kill the server and take its port. Until the port is ours: a server the API restarted on it is killed
    too, and a killed server's forked child (an AOF rewrite) that still holds the socket is waited out."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for other in servers_of(home):
            os.kill(other, signal.SIGKILL)
        squatter = socket.socket()
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            squatter.bind(("127.0.0.1", port))
        except OSError:
            squatter.close()
            time.sleep(0.05)
            continue
        while servers_of(home):  # the killed ones gone before the test restarts the server
            time.sleep(0.05)
        with squatter:
            squatter.listen()
            yield squatter
        return
    raise AssertionError(f"port {port} stayed taken for 60 s")
