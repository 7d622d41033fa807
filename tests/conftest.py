"""Shared fixtures: tiny random Llama models built from a config (no download) and the SmolLM2 path;
and the session's own SLUICE_HOME, so the suite never touches the user's data directory or Redis, with
a check at the end that no job server the run started is still running."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import shutil
import subprocess
import sys
import tempfile

# Triton kernels run under the interpreter on CPU; this must be set before any kernel is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

# `python -m pytest` puts the checkout first on sys.path, where engine/, kernels/, ... would import as
# top-level packages: transformers' `import kernels` (Hugging Face's package) would get ours. The suite
# imports Sluice as sluice.* only; the checkout goes last, where it still serves an uninstalled copy's
# `import sluice` (the GPU machine's) and `bench.*`.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT] + [_ROOT]
# The tests live in folders mirroring the packages (tests/engine/, tests/jobs/, ...); what they share
# (fixtures, helpers, fake engines) is in tests/support/, imported by its bare module names.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))

from collections.abc import Callable, Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers import make_tiny_model  # noqa: E402
from stray_servers import RUN_MARK, kill, stray_servers  # noqa: E402

# Set while this module is imported, before any test module is, so every import, subprocess and
# embedded server of the run sees them: a test that sets no SLUICE_HOME of its own uses this one.
SESSION_HOME = Path(tempfile.mkdtemp(prefix="sluice-test-home-"))
os.environ["SLUICE_HOME"] = str(SESSION_HOME)
os.environ.pop("SLUICE_REDIS_URL", None)
os.environ.pop("SLUICE_API_KEY", None)
os.environ[RUN_MARK] = str(os.getpid())  # inherited by whatever the run starts, servers included


@pytest.fixture(scope="session", autouse=True)
def no_server_left_behind() -> Iterator[None]:
    """Torn down last: every embedded server a test started must have been stopped by then."""
    yield
    left = stray_servers(str(os.getpid()))
    kill(left)
    shutil.rmtree(SESSION_HOME, ignore_errors=True)
    assert not left, f"the tests left job servers running (killed now): {left}"


@pytest.fixture(autouse=True)
def no_server_in_the_session_home() -> Iterator[None]:
    """A test that needs a job server sets its own SLUICE_HOME; one left running in the session's names
    the test that started it (a server in the user's data directory, before the session set its own)."""
    yield
    from sluice.jobs.connection import find_server, stop_server

    found = find_server(SESSION_HOME)
    if found is not None:
        starter = _starter(found.pid)
        stop_server(SESSION_HOME, kill=True)
        pytest.fail("this test left an embedded job server running in the session's SLUICE_HOME (stopped now): "
                    f"give it its own SLUICE_HOME and stop what it starts. It was started by {starter}")


def _starter(pid: int) -> str:
    """Who launched server ``pid``: its parent's pid and command line (this process: a thread of the tests),
    for a failure that names the culprit."""
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        cmd = Path(f"/proc/{ppid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, ValueError, IndexError) as e:
        return f"an unknown process ({e})"
    return f"pid {ppid}{' (the test process)' if ppid == os.getpid() else ''}: {cmd[:300]}"


def _malloc_trim() -> Callable[[], object]:
    """glibc's malloc_trim, or a no-op where the C library has none (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return lambda *_: 0


_TRIM = _malloc_trim()


@pytest.fixture(autouse=True)
def memory_back_to_the_system() -> Iterator[None]:
    """After each test, the C heap's free memory goes back to the system. What a test frees (an engine's
    weights, a reference model) stays in glibc's arenas otherwise: tensors of a few MB come from the heap
    once glibc's mmap threshold has risen, and the heap is trimmed only at its top, so the suite's process
    stayed large with no engine and no tensor alive at a module's end (SLUICE_TEST_RSS=1 below). SmolLM2
    built and freed three times in one process: 1.49 GB resident, 0.91 GB after the free, 0.19 GB after a
    trim."""
    yield
    _TRIM(0)


@pytest.fixture(scope="module", autouse=True)
def module_garbage_collected() -> Iterator[None]:
    """At each module's end, reference cycles that hold engines or models are collected before the trim."""
    yield
    gc.collect()
    _TRIM(0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer GQA Llama with random weights and SmolLM2's tokenizer, saved as a local directory."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MB filesystem (tmpfs), so a full disk is the kernel's ENOSPC, not a fake."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root): no real full disk to test against")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# SLUICE_TEST_RSS=1: log this process's resident memory after every test (to SLUICE_TEST_RSS_LOG, default
# stderr), so a module whose engines, models or caches outlive it shows up as a step that never comes down;
# at each module's end, also what is still alive then: engines, and tensor bytes by storage.
if os.environ.get("SLUICE_TEST_RSS") == "1":
    import sys

    def _rss_kib() -> dict[str, int]:
        fields = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "VmHWM", "VmRSS"):
                fields[key] = int(value.split()[0])
        return fields

    def _alive() -> str:
        import torch
        from sluice.engine.llm import LLM

        gc.collect()
        engines, storages = 0, {}
        for o in gc.get_objects():
            if isinstance(o, LLM):
                engines += 1
            elif isinstance(o, torch.Tensor) and o.device.type == "cpu":
                try:
                    st = o.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
                except RuntimeError:  # a tensor without data (its storage freed or never allocated)
                    continue
        return f"alive: {engines} engines, {len(storages)} tensor storages of {sum(storages.values()) >> 20} MiB"

    def _log(line: str) -> None:
        target = os.environ.get("SLUICE_TEST_RSS_LOG")
        if target:
            with open(target, "a") as f:
                f.write(line)
        else:
            sys.stderr.write(line)

    _last_module: list[str] = [""]

    def pytest_runtest_logfinish(nodeid: str, location: tuple[str, int | None, str]) -> None:
        rss = _rss_kib()
        _log(f"RSS anon={rss['RssAnon'] // 1024} MiB rss={rss['VmRSS'] // 1024} MiB "
             f"peak={rss['VmHWM'] // 1024} MiB after {nodeid}\n")

    def pytest_runtest_setup(item: pytest.Item) -> None:
        module = item.nodeid.split("::")[0]
        if _last_module[0] and module != _last_module[0]:  # the previous module's fixtures are gone by now
            _log(f"MODULE {_last_module[0]} done; {_alive()}; RSS anon={_rss_kib()['RssAnon'] // 1024} MiB\n")
        _last_module[0] = module
