"""Reads of the job plane (batch status, results in completion order, dead letters) and cancels."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import redis
from sluice.jobs import keys, spill
from sluice.jobs.consumer.commands import publish_cancel
from sluice.jobs.full import CANCEL_REFUSED, refused_when_full
from sluice.jobs.openai_output import result_to_output_line
from sluice.jobs.schemas import (
    CHAT_URL,
    FINAL_BATCH_STATUSES,
    Batch,
    BatchCounts,
    DeadLetter,
    LineErrorInfo,
    Result,
    ResultUsage,
    WorkerHeartbeat,
)
from sluice.jobs.scripts import Scripts, results_after, sweep, transition

_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
          "cancelling_at", "cancelled_at")
SWEEP_CHUNK = 1000  # jobs per sweep script call, so no single call holds the server long


# ---- batches -------------------------------------------------------------------------------------
def batch_from_meta(meta: dict[str, str], errors: list[str] | None = None) -> Batch:
    counts = BatchCounts(**{k: int(meta.get(k) or 0) for k in BatchCounts.model_fields})
    times: dict[str, Any] = {k: float(meta[k]) if meta.get(k) else None for k in _TIMES}
    return Batch(id=meta["id"], model=keys.queue_name(meta.get("model")), status=meta["status"], counts=counts,
                 endpoint=meta.get("endpoint") or CHAT_URL,
                 priority=int(meta.get("priority") or 0), input=meta.get("input") or None,
                 metadata=json.loads(meta.get("metadata") or "{}"),
                 dataset=json.loads(meta["dataset"]) if meta.get("dataset") else None,
                 errors=[LineErrorInfo.model_validate_json(e) for e in errors or []],
                 usage=ResultUsage(**{k: int(meta.get(k) or 0) for k in ResultUsage.model_fields}),
                 completion_window=meta.get("completion_window") or "24h",
                 output_expires_after=float(meta["output_expires_after"]) if meta.get("output_expires_after") else None,
                 paused_at=float(meta["paused_at"]) if meta.get("paused_at") else None,
                 **times)


def get_batch(r: redis.Redis, batch_id: str, *, max_errors: int = 20) -> Batch | None:
    """A batch's status, counters, timestamps and its first ``max_errors`` bad lines; None if unknown."""
    pipe = r.pipeline(transaction=False)
    pipe.hgetall(keys.meta(batch_id))
    pipe.lrange(keys.line_errors(batch_id), 0, max_errors - 1)
    meta, errors = pipe.execute()
    return batch_from_meta(meta, errors) if meta else None


def list_batches(r: redis.Redis, *, limit: int = 20, before: float | None = None,
                 after: float | None = None) -> list[Batch]:
    """Newest first; ``before`` (a created_at) pages back. With ``after`` instead: the first ones created
    after it, oldest first (a page forward)."""
    if after is not None:
        ids = r.zrangebyscore(keys.all_batches(), f"({after}", "+inf", start=0, num=limit)
    else:
        top = f"({before}" if before is not None else "+inf"
        ids = r.zrevrangebyscore(keys.all_batches(), top, "-inf", start=0, num=limit)
    pipe = r.pipeline(transaction=False)
    for bid in ids:
        pipe.hgetall(keys.meta(bid))
    return [batch_from_meta(m) for m in pipe.execute() if m]


@dataclass
class BatchPage:
    batches: list[Batch]
    has_more: bool

    def to_openai(self, render: Callable[[Batch], dict[str, Any]] = Batch.to_openai) -> dict[str, Any]:
        """OpenAI's list object, each batch rendered by ``render``."""
        data = [render(b) for b in self.batches]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": self.has_more}


def page_batches(r: redis.Redis, *, limit: int = 20, after: str | None = None) -> BatchPage | None:
    """One page of the batch list, newest first, continuing after the batch ``after`` (OpenAI's cursor);
    None if ``after`` names no batch. The CLI's ``batches --after`` and ``GET /v1/batches`` both page here."""
    before = None
    if after is not None:
        cursor = get_batch(r, after, max_errors=0)
        if cursor is None:
            return None
        before = cursor.created_at
    batches = list_batches(r, limit=limit + 1, before=before)
    return BatchPage(batches[:limit], len(batches) > limit)


def count_batches(r: redis.Redis) -> int:
    """How many batches the job server holds."""
    return r.zcard(keys.all_batches())


def set_batch_options(r: redis.Redis, batch_id: str, completion_window: str,
                      output_expires_after: float | None) -> None:
    """What the API's batch create was given beyond the jobs (OpenAI's Batch object echoes them)."""
    fields: dict[str, Any] = {"completion_window": completion_window}
    if output_expires_after is not None:
        fields["output_expires_after"] = output_expires_after
    r.hset(keys.meta(batch_id), mapping=fields)


def get_line_errors(r: redis.Redis, batch_id: str) -> list[LineErrorInfo]:
    return [LineErrorInfo.model_validate_json(e) for e in r.lrange(keys.line_errors(batch_id), 0, -1)]


def priorities(r: redis.Redis, batch_id: str) -> list[int]:
    raw = r.hget(keys.meta(batch_id), "priorities") or ""
    return [int(p) for p in raw.split(",") if p]


def retire_batch(r: redis.Redis, batch_id: str, now: float | None = None) -> None:
    """After a batch reached a final state: out of the open set and its streams off the queue.
    Idempotent; housekeeping repeats it for a process that died between the two."""
    now = now if now is not None else time.time()
    model, on_complete, events = r.hmget(keys.meta(batch_id), "model", "on_complete", "events")
    if model is None:  # deleted meanwhile (a Celery generate drops its batch once read): nothing to index
        r.zrem(keys.open_batches(), batch_id)
        return
    if on_complete:  # before leaving the open set: housekeeping retries a retire that died before this
        queue_completion(r, batch_id, now)
    pipe = r.pipeline(transaction=False)
    if events == "1":  # before leaving the open set, as the completion above: its event waits for a webhook
        pipe.zadd(keys.webhooks_due(), {batch_id: now}, nx=True)
    pipe.zrem(keys.open_batches(), batch_id)
    pipe.zadd(keys.finished_batches(), {batch_id: now}, nx=True)
    streams = [keys.jobs(batch_id, p) for p in priorities(r, batch_id)]
    if streams:
        pipe.zrem(keys.active_streams(keys.queue_name(model)), *streams)
        pipe.zrem(keys.ready_streams(keys.queue_name(model)), *streams)
    pipe.execute()


def queue_completion(r: redis.Redis, batch_id: str, now: float) -> bool:
    """Queue the batch's completion signature for the Celery side, once, after its last outcome.

    The HSETNX is the claim: of all the processes that retire a batch (the worker writing its last
    result, a canceller, housekeeping retrying), one queues it. At most once: a process dying between
    the claim and the RPUSH loses it."""
    if not settled(r, batch_id):
        return False  # an expired batch is final before its sweep wrote every outcome; the sweep retires it again
    if not r.hsetnx(keys.meta(batch_id), "on_complete_queued_at", now):
        return False
    r.rpush(keys.completions(), batch_id)
    return True


def delete_batch(r: redis.Redis, batch_id: str) -> None:
    """Every key of the batch, and its place in the indexes."""
    model = keys.queue_name(r.hget(keys.meta(batch_id), "model"))
    prios = priorities(r, batch_id)
    r.delete(*keys.batch_keys(batch_id, prios))  # one slot: one DEL, also on a cluster
    spill.remove(spill.files_dir(), batch_id)
    pipe = r.pipeline(transaction=False)
    for idx in (keys.all_batches(), keys.open_batches(), keys.finished_batches(), keys.webhooks_due()):
        pipe.zrem(idx, batch_id)
    if prios:
        pipe.zrem(keys.active_streams(model), *(keys.jobs(batch_id, p) for p in prios))
        pipe.zrem(keys.ready_streams(model), *(keys.jobs(batch_id, p) for p in prios))
    pipe.execute()


# ---- results -------------------------------------------------------------------------------------
@dataclass
class ResultsPage:
    results: list[Result]
    cursor: str  # pass back to read on after the last result returned


def read_results(r: redis.Redis, batch_id: str, cursor: str = "0", limit: int = 1000) -> ResultsPage:
    """Results in completion order, after ``cursor`` ("0": from the start): from the files results were
    spilled to (jobs/spill.py) up to the spilled cursor, then from the results stream."""
    got: list[tuple[str, str]] = []
    cursor = cursor or "0"
    scripts = Scripts(r)
    while len(got) < limit:
        start = "-" if cursor == "0" else f"({cursor}"
        spilled, entries = results_after(scripts, batch_id, start, limit - len(got))
        from_files = bool(spilled) and spill.id_key(cursor) < spill.id_key(spilled)
        if from_files:
            more = spill.read(r, spill.files_dir(), batch_id, cursor, limit - len(got))
        else:
            more = [(eid, dict(zip(fields[::2], fields[1::2], strict=True))["r"]) for eid, fields in entries]
        if not more:
            break
        got += _current(r, batch_id, more) if from_files else more
        cursor = more[-1][0]
    return ResultsPage([Result.model_validate_json(res) for _, res in got], cursor)


def _current(r: redis.Redis, batch_id: str, spilled: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The spilled results still their job's outcome: a job run again (jobs/reopen.py) left its old one in a
    file; its entry in the results stream is deleted then, so only files need this check."""
    if not spilled or not r.hexists(keys.meta(batch_id), "reopened_at"):
        return spilled
    idxs = [json.loads(res)["idx"] for _, res in spilled]
    return [e for e, rid in zip(spilled, r.hmget(keys.done(batch_id), idxs), strict=True) if e[0] == rid]


def iter_results(r: redis.Redis, batch_id: str, *, cursor: str = "0", follow: bool = False,
                 poll: float = 0.5) -> Iterator[Result]:
    """Every result from ``cursor`` on; with ``follow``, waits for more until the batch is final."""
    while True:
        page = read_results(r, batch_id, cursor)
        yield from page.results
        cursor = page.cursor
        if page.results:
            continue
        if not follow or settled(r, batch_id):
            if follow:  # results written just before the final state
                yield from read_results(r, batch_id, cursor).results
            return
        start = cursor if cursor not in ("", "0") else "0-0"
        r.xread({keys.results(batch_id): start}, count=1, block=int(poll * 1000))


def settled(r: redis.Redis, batch_id: str) -> bool:
    """Final, and every outcome written: an expired batch turns final before its jobs are swept."""
    status, total, *done = r.hmget(keys.meta(batch_id), "status", "total", "completed", "failed", "cancelled",
                                   "expired")
    if status is None:
        return True
    return status in FINAL_BATCH_STATUSES and sum(int(x or 0) for x in done) >= int(total or 0)


def await_result(r: redis.Redis, batch_id: str, block: float) -> Result | None:
    """The batch's first result (a one-job batch's only one), waiting at most ``block`` seconds for it:
    a blocking XREAD the writer's XADD wakes at once, no polling."""
    got = r.xread({keys.results(batch_id): "0-0"}, count=1, block=max(1, int(block * 1000)))
    for _, entries in got or []:
        for _, fields in entries:
            return Result.model_validate_json(fields["r"])
    return None


def recent_results(r: redis.Redis, batch_id: str, n: int = 256) -> list[Result]:
    """The batch's last ``n`` results, oldest first (for throughput and ETA without reading them all)."""
    entries = r.xrevrange(keys.results(batch_id), "+", "-", count=n)
    return [Result.model_validate_json(f["r"]) for _, f in reversed(entries)]


def output_lines(r: redis.Redis, batch_id: str, **kw: Any) -> Iterator[dict[str, Any]]:
    """OpenAI batch output lines, in completion order (``iter_results`` arguments)."""
    for res in iter_results(r, batch_id, **kw):
        yield result_to_output_line(None, res)


def get_result(r: redis.Redis, batch_id: str, custom_id: str) -> Result | None:
    idx = r.hget(keys.custom_ids(batch_id), custom_id)
    rid = r.hget(keys.done(batch_id), idx) if idx is not None else None
    if rid is None:
        return None
    entries = r.xrange(keys.results(batch_id), rid, rid)
    if entries:
        return Result.model_validate_json(entries[0][1]["r"])
    found = spill.find(r, spill.files_dir(), batch_id, rid)  # moved out of Redis
    return Result.model_validate_json(found) if found else None


def dead_letters(r: redis.Redis, batch_id: str) -> list[dict[str, Any]]:
    """Each dead-lettered job's entry (DeadLetter's fields) as a dict."""
    return [DeadLetter.model_validate_json(f["d"]).model_dump() for _, f in r.xrange(keys.dead(batch_id))]


# ---- cancel --------------------------------------------------------------------------------------
def cancel_batch(r: redis.Redis, batch_id: str) -> Batch | None:
    """Cancel a batch: every job without an outcome gets "cancelled" now (completed results stay),
    and workers abort its in-flight sequences on their next step. None if there is no such batch."""
    s = Scripts(r)
    now = time.time()
    with refused_when_full(CANCEL_REFUSED):
        old = transition(s, batch_id, "cancelling", "cancelling_at", now, ("validating", "in_progress"))
        if old is None:
            return None
        if old in ("validating", "in_progress", "cancelling"):
            meta = r.hmget(keys.meta(batch_id), "model", "total")
            publish_cancel(r, keys.queue_name(meta[0]), batch_id, None, "cancelled")
            sweep_all(r, s, batch_id, int(meta[1] or 0), "cancelled", "batch_cancelled", "the batch was cancelled")
    return get_batch(r, batch_id)


def cancel_job(r: redis.Redis, batch_id: str, custom_id: str) -> bool:
    """Cancel one job; False if it already had an outcome (or does not exist)."""
    idx = r.hget(keys.custom_ids(batch_id), custom_id)
    if idx is None:
        return False
    s = Scripts(r)
    now = time.time()
    with refused_when_full(CANCEL_REFUSED):
        written, fin = sweep(s, batch_id, [int(idx)], "cancelled", "cancelled", "the job was cancelled", now)
        if written:
            model = keys.queue_name(r.hget(keys.meta(batch_id), "model"))
            publish_cancel(r, model, batch_id, idx, "cancelled")
        if fin:
            retire_batch(r, batch_id, now)
    return bool(written)


def expire_batch(r: redis.Redis, batch_id: str, now: float | None = None) -> bool:
    """The completion window ran out: jobs without an outcome get "expired" (OpenAI's batch_expired)."""
    s = Scripts(r)
    now = now if now is not None else time.time()
    old = transition(s, batch_id, "expired", "expired_at", now, ("in_progress",))
    if old != "in_progress":
        return False
    meta = r.hmget(keys.meta(batch_id), "model", "total")
    publish_cancel(r, keys.queue_name(meta[0]), batch_id, None, "expired")
    sweep_all(r, s, batch_id, int(meta[1] or 0), "expired", "batch_expired", "the batch expired")
    return True


def sweep_all(r: redis.Redis, s: Scripts, batch_id: str, total: int, status: str, code: str, msg: str) -> None:
    """Outcome ``status`` for every job of the batch without one, a chunk at a time; retires it once final."""
    now = time.time()
    for start in range(0, total, SWEEP_CHUNK):
        idxs = list(range(start, min(start + SWEEP_CHUNK, total)))
        _, fin = sweep(s, batch_id, idxs, status, code, msg, now)
        if fin:
            retire_batch(r, batch_id, now)
    if status == "expired":  # an expired batch is final even if every job already had its outcome
        retire_batch(r, batch_id, now)


# ---- queue and workers ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Backlog:
    """A model's queue as an autoscaler reads it: ``queued`` jobs not yet delivered to any worker and
    ``in_flight`` ones a worker holds (delivered, not yet written back; a dead worker's too, until claimed)."""

    queue: str
    queued: int
    in_flight: int

    @property
    def backlog(self) -> int:
        """What workers are needed for: zero only when no job of the queue is waiting or held."""
        return self.queued + self.in_flight

    def to_dict(self) -> dict[str, Any]:
        return {"queue": self.queue, "queued": self.queued, "in_flight": self.in_flight, "backlog": self.backlog}


def queue_backlog(r: redis.Redis, queue: str) -> Backlog:
    """A model's jobs queued and in flight over its open batches' streams (acked entries are deleted from a
    stream, so its length less its pending entries is what no worker took yet)."""
    streams = r.zrange(keys.active_streams(queue), 0, -1)
    pipe = r.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
        pipe.xpending(s, keys.GROUP)
    out = pipe.execute(raise_on_error=False) if streams else []
    queued = in_flight = 0
    for length, pending in zip(out[::2], out[1::2], strict=True):
        if isinstance(length, int) and isinstance(pending, dict):
            held = int(pending.get("pending") or 0)
            queued += length - held
            in_flight += held
    return Backlog(queue, queued, in_flight)


def queue_depth(r: redis.Redis, queue: str) -> int:
    """Jobs of a model not yet delivered to any worker."""
    return queue_backlog(r, queue).queued


def queues_with_jobs(r: redis.Redis) -> set[str]:
    """The queues (model names) with an open batch, whether or not a worker serves them."""
    return {keys.queue_of_active_streams(k) for k in r.scan_iter(match=keys.active_streams("*"), count=1000)}


def pending_under(r: redis.Redis, batch_id: str, consumer: str) -> int:
    """Jobs of a batch delivered to ``consumer`` and not yet acknowledged: what Redis says it holds."""
    total = 0
    for p in priorities(r, batch_id):
        for c in r.xpending(keys.jobs(batch_id, p), keys.GROUP)["consumers"]:
            total += int(c["pending"]) if c["name"] == consumer else 0
    return total


def list_workers(r: redis.Redis) -> list[WorkerHeartbeat]:
    """What each live worker last said in its heartbeat."""
    names = list(r.scan_iter(match=keys.worker_pattern(), count=1000))  # on a cluster: every primary
    pipe = r.pipeline(transaction=False)  # not MGET: on a cluster the heartbeats are spread over slots
    for name in names:
        pipe.get(name)
    values = pipe.execute() if names else []
    return [w for w in map(WorkerHeartbeat.read, values) if w is not None]


def served_queues(r: redis.Redis) -> set[str]:
    """The queues (model names) live workers serve."""
    return {w.queue for w in list_workers(r) if w.queue}


def served_kinds(r: redis.Redis) -> dict[str, set[str]]:
    """What live workers serve, per queue: "generation" and/or "embedding" (a heartbeat without the
    field is an older worker's: generation). A queue without a named model is "default"."""
    kinds: dict[str, set[str]] = {}
    for w in list_workers(r):
        kinds.setdefault(w.queue_name, set()).add(w.serves)
    return kinds
