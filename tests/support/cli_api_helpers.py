"""Helpers of the CLI and API tests: a module-wide SLUICE_HOME with its embedded Valkey, a worker on the
tiny model in a thread, ``sluice`` subprocesses, random request lines."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from jobs_helpers import ThreadWorker, wait_for
from sluice.jobs.connection import ENV_HOME, ENV_URL, ensure_server, stop_server

SLUICE = str(Path(sys.executable).with_name("sluice"))
ROOT = Path(__file__).resolve().parents[2]
WORDS = ["sluice", "river", "gate", "water", "stone", "mill", "wheel", "bank", "flow", "lock", "weir", "canal"]


@contextmanager
def sluice_home(path: Path) -> Iterator[Path]:
    """SLUICE_HOME at ``path`` for the duration (module-wide: pytest's monkeypatch is per test), its
    embedded server started, and killed at the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_HOME, str(path))
        for name in (ENV_URL, "SLUICE_API_KEY", "SLUICE_FILES_DIR"):
            mp.delenv(name, raising=False)
        ensure_server(path)
        try:
            yield path
        finally:
            stop_server(path, kill=True)


@contextmanager
def tiny_worker(model_dir: Path, queue: str = "tiny", **opts: Any) -> Iterator[ThreadWorker]:
    """A worker on the tiny model in a thread of the test process, serving ``queue``."""
    from sluice.engine.llm import LLM

    llm = LLM(str(model_dir), dtype="float32", max_num_seqs=16, kv_cache_memory=8 << 20)
    w = ThreadWorker(llm, queue=queue, **opts)
    try:
        yield w
    finally:
        w.join()


def chat_lines(rng: Any, n: int, max_tokens: int = 4, model: str | None = None, prefix: str = "req") -> list[str]:
    """OpenAI batch lines for /v1/chat/completions with random short prompts."""
    lines = []
    for i in range(n):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": _words(rng)}], "max_tokens": max_tokens}
        if model is not None:
            body["model"] = model
        lines.append(json.dumps({"custom_id": f"{prefix}-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return lines


def simple_lines(rng: Any, n: int, max_tokens: int = 4, prefix: str = "job", **extra: Any) -> list[str]:
    """Simple {"prompt"} lines with random short prompts."""
    return [json.dumps({"custom_id": f"{prefix}-{i}", "prompt": _words(rng), "max_tokens": max_tokens, **extra})
            for i in range(n)]


def _words(rng: Any) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 9)))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_sluice(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``sluice ARGS`` as a real subprocess."""
    return subprocess.run([SLUICE, *args], cwd=ROOT, env=env or dict(os.environ), capture_output=True, text=True,
                          timeout=timeout)


def default_sigint() -> None:
    """A ``preexec_fn``: SIGINT at its default, as a terminal gives the command it runs. A test run started
    as a background job (``make test &``) ignores SIGINT, its children inherit that, and Python installs
    no Ctrl-C handler in a process that starts with SIGINT ignored: a Ctrl-C sent by a test would be lost."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start_sluice(*args: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A long-running ``sluice ARGS`` (serve, up) logging to ``log``; Ctrl-C (``stop``) reaches it."""
    out = log.open("ab")
    return subprocess.Popen([SLUICE, *args], cwd=ROOT, env=env or dict(os.environ), stdout=out,
                            stderr=subprocess.STDOUT, preexec_fn=default_sigint)


def wait_for_url(proc: subprocess.Popen, log: Path, timeout: float = 120) -> str:
    """The http://host:port the process says it listens on (``--port 0`` picks a free one)."""

    def found() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(f"sluice exited with {proc.returncode}:\n{log.read_text()}")
        m = re.search(r"(http://[\d.]+:\d+)/v1", log.read_text())
        return m.group(1) if m else None

    return wait_for(found, timeout, f"the API address in {log}", every=0.1)


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    """SIGINT (Ctrl-C), then its exit code."""
    if proc.poll() is None:
        proc.send_signal(2)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextmanager
def serving(log: Path, key: str | None = None, **env: str) -> Iterator[str]:
    """A real ``sluice serve`` on a free port (on the current SLUICE_HOME's job server), with ``key`` as its
    SLUICE_API_KEY: its URL; stopped with Ctrl-C after, which must exit cleanly."""
    proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log,
                        env={**os.environ, **({"SLUICE_API_KEY": key} if key else {}), **env})
    try:
        yield wait_for_url(proc, log, timeout=60)
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]


@contextmanager
def served_client(tmp_path: Path, key: str) -> Iterator[Any]:
    """An httpx client holding ``key``, on a real ``sluice serve`` whose uploads go under ``tmp_path``."""
    import httpx

    with serving(tmp_path / "serve.log", key, SLUICE_FILES_DIR=str(tmp_path / "files")) as url, \
            httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        yield http


def wait_final(get: Any, timeout: float = 120) -> Any:
    """Poll ``get()`` (a batch in OpenAI's shape, as a dict or an SDK object) until it is final."""
    final = {"completed", "failed", "cancelled", "expired"}

    def status() -> Any:
        b = get()
        return b if (b["status"] if isinstance(b, dict) else b.status) in final else None

    return wait_for(status, timeout, "the batch to finish", every=0.2)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def elapsed(t0: float) -> str:
    return f"{time.monotonic() - t0:.1f}s"
