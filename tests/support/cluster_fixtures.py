"""Fixtures of the cluster tests: a real 3-primary Valkey Cluster on loopback (``sluice.jobs.local_cluster``),
one per test module, every node killed at the end; loaded with ``pytest_plugins = ["cluster_fixtures"]``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sluice.jobs.connection import ENV_HOME, ENV_URL, connect
from sluice.jobs.local_cluster import LocalCluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster(tmp_path_factory.mktemp("cluster"), primaries=3)
    with c:
        yield c


@pytest.fixture
def cr(cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[redis.Redis]:
    """A cluster client (redis-py's RedisCluster) of an emptied cluster; SLUICE_REDIS_URL names the
    cluster for everything the test starts (workers, the API, subprocesses)."""
    monkeypatch.setenv(ENV_URL, cluster.url)
    monkeypatch.setenv(ENV_HOME, str(tmp_path / "home"))
    cluster.wait_ok()
    client = connect(cluster.url)
    client.flushall()  # every primary
    yield client
    client.close()
