"""Interactive requests (the API's ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``) on
the job plane.

- A request is a one-job batch ``req_<hex>`` (``submit.submit_job``) at the interactive priority, so
  workers pull it before batch work, and it has every guarantee of a batch job: re-run by another
  worker after a crash, cancelled like any job, exactly one outcome.
- Admission: its id joins ``keys.interactive(queue)`` (a sorted set by admission time); a request that
  finds it holding ``bound`` others is refused (the API's 429) and queues nothing. Entries older than
  ``stale_after`` (an API that died mid-request) are dropped at each admission.
- Waiting: one blocking XREAD on the batch's results stream (and its deltas stream when streaming),
  which the worker's XADD wakes: no polling.
- Streaming: a worker appends each step's new text of a streaming job to ``keys.deltas(batch_id)``
  (fields: ``w`` worker id, ``a`` its attempt, ``n`` sample index, ``t`` text); the final result's text
  completes what the deltas did not carry. A run that changes (another worker or attempt) once text was
  sent, or a running worker whose heartbeat is gone, ends the stream with an error: no hang.
- Once answered (or cancelled), the request's keys are deleted; the deltas stream also has a TTL. A worker
  appends deltas only while the request's meta key exists, so a late append never recreates the stream.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncCluster
from sluice.jobs import keys, scripts
from sluice.jobs.connection import is_cluster_url, redis_url
from sluice.jobs.full import NOTHING_QUEUED, refused_when_full
from sluice.jobs.pipes import NodePipes
from sluice.jobs.schemas import Result
from sluice.jobs.scripts import Scripts
from sluice.jobs.store import cancel_batch, delete_batch

PREFIX = "req_"
DELTAS_TTL = 3600  # seconds a deltas stream outlives its last append (an API that died leaves it behind)


def new_request_id() -> str:
    return f"{PREFIX}{uuid.uuid4().hex[:24]}"


# ---- admission (sync: the API runs these in its thread pool) --------------------------------------
def admit(r: redis.Redis, queue: str, batch_id: str, bound: int, stale_after: float) -> bool:
    """Count the request among the queue's waiting interactive requests, unless ``bound`` are waiting."""
    now = time.time()
    key = keys.interactive(queue)
    pipe = r.pipeline(transaction=True)
    pipe.zremrangebyscore(key, "-inf", now - stale_after)
    pipe.zadd(key, {batch_id: now})
    pipe.zcard(key)
    with refused_when_full(NOTHING_QUEUED):  # a refused ZADD discards the whole transaction: nothing kept
        admitted = pipe.execute()[-1] <= bound
    if admitted:
        return True
    r.zrem(key, batch_id)  # over the bound: never over-admits (two at the edge may both be refused)
    return False


def waiting(r: redis.Redis, queue: str) -> int:
    return int(r.zcard(keys.interactive(queue)))


def close(r: redis.Redis, queue: str, batch_id: str, cancel: bool) -> None:
    """The request is answered or given up (``cancel``: its job is cancelled first, so a worker running it
    aborts it): its keys go, even when the cancel is refused (a full job server: deletes are allowed)."""
    try:
        if cancel:
            cancel_batch(r, batch_id)
    finally:
        delete_batch(r, batch_id)
        r.delete(keys.deltas(batch_id))
        r.zrem(keys.interactive(queue), batch_id)


# ---- the worker's side: text deltas -----------------------------------------------------------------
def append_deltas(r: redis.Redis, s: Scripts, worker: str, texts: list[tuple[str, int, int, str]]) -> None:
    """The new text of streaming jobs, (batch id, attempt, sample index, text) each, in one round trip (one a
    node on a cluster). Appended only while the request's keys exist: never after the API deleted them
    (scripts.APPEND_DELTAS). Raises the first error reply."""
    pipes = NodePipes(r)
    for batch_id, attempt, index, text in texts:
        scripts.append_deltas(s, batch_id, worker, attempt, [(index, text)], DELTAS_TTL, pipes.on(keys.meta(batch_id)))
    for reply in pipes.execute():
        if isinstance(reply, Exception):
            raise reply


# ---- the API's side: waiting ------------------------------------------------------------------------
@dataclass
class Delta:
    run: tuple[str, str]  # (worker id, attempt): who generated this text
    index: int
    text: str


@dataclass
class Waiter:
    """Follows one request's results (and deltas) streams with blocking reads."""

    ar: aioredis.Redis
    batch_id: str
    deltas: bool
    _results_at: str = "0-0"
    _deltas_at: str = "0-0"

    async def read(self, block_s: float) -> tuple[list[Delta], Result | None]:
        """What came since the last call, waiting up to ``block_s`` for something: the deltas in order,
        and the result once it is written."""
        streams = {keys.results(self.batch_id): self._results_at}
        if self.deltas:
            streams[keys.deltas(self.batch_id)] = self._deltas_at
        got = await self.ar.xread(streams, count=1024, block=max(1, int(block_s * 1000)))
        out: list[Delta] = []
        result = None
        for key, entries in got or []:
            for eid, f in entries:
                if key == keys.results(self.batch_id):
                    self._results_at = eid
                    result = Result.model_validate_json(f["r"])
                else:
                    self._deltas_at = eid
                    out.append(Delta((f["w"], f["a"]), int(f["n"]), f["t"]))
        return out, result

    async def worker_alive(self, worker_id: str) -> bool:
        return bool(await self.ar.exists(keys.heartbeat(worker_id)))


def async_connect(url: str | None, max_waiting: int) -> aioredis.Redis:
    """An asyncio client of the job server. Each waiting request holds a connection for its blocking read
    (a connection each, not a thread each): room for ``max_waiting`` of them, and a few more."""
    url = url or redis_url()
    opts: dict[str, Any] = {"decode_responses": True, "socket_connect_timeout": 2.0, "health_check_interval": 30,
                            "max_connections": max_waiting + 64}
    if is_cluster_url(url):
        return AsyncCluster.from_url(url.replace("+cluster", "", 1), **opts)  # type: ignore[return-value]
    return aioredis.Redis.from_url(url, **opts)
