"""The ``s3`` fixture: a real S3-compatible server (moto's server mode on 127.0.0.1, no mocks of
fsspec or boto), loaded with ``pytest_plugins = ["s3_fixtures"]`` by the dataset tests."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A real S3-compatible server (moto's server mode on 127.0.0.1) and storage options for it."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(k, "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the journal of a remote output
    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "testing", "secret": "testing"}
    import requests
    import s3fs

    requests.post(f"{opts['endpoint_url']}/moto-api/reset", timeout=10)  # moto's state is per process
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    fs.mkdir("sluice-test")
    try:
        yield {"opts": opts, "fs": fs}
    finally:
        requests.post(f"{opts['endpoint_url']}/moto-api/reset", timeout=10)
        server.stop()
