"""Fixtures of the job-plane tests, loaded with ``pytest_plugins = ["jobs_fixtures"]`` by
tests/test_jobs*.py and tests/test_worker*.py (kept out of the shared conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sluice.jobs.connection import ENV_HOME, ENV_URL, connect, ensure_server, stop_server


@pytest.fixture
def sluice_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh SLUICE_HOME whose embedded server is stopped at the end."""
    home = tmp_path / "home"
    monkeypatch.setenv(ENV_HOME, str(home))
    monkeypatch.delenv(ENV_URL, raising=False)
    yield home
    stop_server(home, kill=True)


@pytest.fixture
def r(sluice_home: Path) -> Iterator[redis.Redis]:
    """A client of the test's own embedded Valkey."""
    ensure_server(sluice_home)
    client = connect()
    yield client
    client.close()
