"""Shared fixtures: tiny random Llama models built from a config (no download) and the SmolLM2 path;
and the session's own SLUICE_HOME, so the suite never touches the user's data directory or Redis, with
a check at the end that no job server the run started is still running."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

# Triton kernels run under the interpreter on CPU; this must be set before any kernel is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Iterator  # noqa: E402
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
    from jobs.connection import find_server, stop_server

    if find_server(SESSION_HOME) is not None:
        stop_server(SESSION_HOME, kill=True)
        pytest.fail("this test left an embedded job server running in the session's SLUICE_HOME (stopped now): "
                    "give it its own SLUICE_HOME and stop what it starts")


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
