"""Pipelined commands that may include Lua scripts, on one server or a Redis Cluster.

redis-py's cluster pipeline refuses EVALSHA, so on a cluster each command goes to a plain pipeline of
the node that owns its key (every script's keys share one batch's hash tag: one slot, one node), and
the node pipelines run one after another, in the order each node was first used. A plain pipeline
loads its scripts before it runs (SCRIPT EXISTS / LOAD), so a node restarted without them is fine.
Across nodes there is no ordering: a write that must land after another (a stream's ZADD into the
ready set after its XADD) is executed in a second ``NodePipes``.
"""

from __future__ import annotations

from typing import Any

import redis
from sluice.jobs.connection import is_cluster

# Replies that say the client's map of slots to nodes is stale (a resharding, a failover).
_STALE_MAP = (redis.exceptions.MovedError, redis.exceptions.AskError)


class NodePipes:
    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self.cluster = is_cluster(r)
        self._pipes: dict[str, Any] = {}  # node name -> its pipeline, in order of first use
        self._order: list[str] = []  # the node of each command queued, in queue order

    def on(self, key: str) -> Any:
        """The pipeline to queue the next command (exactly one) on: the one of ``key``'s node."""
        name = self._node_name(key)
        pipe = self._pipes.get(name)
        if pipe is None:
            client = self.r.get_redis_connection(self.r.get_node_from_key(key)) if self.cluster else self.r
            pipe = self._pipes[name] = client.pipeline(transaction=False)
        self._order.append(name)
        return pipe

    def __len__(self) -> int:
        return len(self._order)

    def execute(self) -> list[Any]:
        """The replies in the order the commands were queued; an error is its exception, in its place
        (a node that could not be reached: every one of its replies is that error)."""
        replies: dict[str, list[Any]] = {}
        for name, pipe in self._pipes.items():
            n = sum(1 for x in self._order if x == name)
            try:
                replies[name] = pipe.execute(raise_on_error=False)
            except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
                replies[name] = [e] * n
        if self.cluster and any(isinstance(x, _STALE_MAP) for rs in replies.values() for x in rs):
            self.r.nodes_manager.initialize()  # the next try goes to the right nodes
        its = {name: iter(rs) for name, rs in replies.items()}
        return [next(its[name]) for name in self._order]

    def _node_name(self, key: str) -> str:
        return self.r.get_node_from_key(key).name if self.cluster else ""
