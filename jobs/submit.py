"""Submission: input lines -> validated jobs -> pipelined XADD into the batch's job streams.

A bad line is recorded (line number, code, message) and never enqueued. Jobs go out in chunks of one
pipeline each, so workers start on the first chunk while the rest is still being read; the batch is
``validating`` until the last line is in, then ``in_progress``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import redis
from sluice.jobs import keys
from sluice.jobs.connection import connect
from sluice.jobs.consumer.commands import mark_ready
from sluice.jobs.embeddings import EMBEDDINGS_URL
from sluice.jobs.full import NOTHING_QUEUED, refused_when_full
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.pipes import NodePipes
from sluice.jobs.prefix_plan import groups, plan_key
from sluice.jobs.schemas import (
    CHAT_URL,
    COMPLETIONS_URL,
    MAX_PRIORITY,
    Batch,
    Job,
    LineErrorInfo,
    SamplingParams,
)
from sluice.jobs.scoring import KIND_URLS
from sluice.jobs.scripts import Scripts, enqueue, finish, transition
from sluice.jobs.settings import MAX_DELIVERIES_KEY, parse_max_deliveries
from sluice.jobs.store import delete_batch, get_batch, retire_batch, served_queues, sweep_all
from sluice.jobs.tracing import Submitted

DEFAULT_WINDOW = 24 * 3600.0  # seconds a batch may take before it expires (OpenAI's "24h")
CHUNK = 2000  # jobs per pipeline round trip
FLUSH_EVERY = 30.0  # seconds a slow producer's lines wait at most: each flush also shows housekeeping we live


def submit(lines: Iterable[str], *, r: redis.Redis | None = None, model: str | None = None,
           defaults: SamplingParams | None = None, priority: int = 0,
           completion_window: float = DEFAULT_WINDOW, metadata: dict[str, str] | None = None,
           input_name: str | None = None, batch_id: str | None = None, chunk: int = CHUNK,
           endpoint: str | None = None, on_complete: dict[str, Any] | None = None,
           line_errors: Iterable[LineErrorInfo] = (), dataset: dict[str, Any] | None = None,
           plan: bool = True) -> Batch:
    """Queue a batch from JSONL lines (OpenAI batch or simple); returns its status after submission.

    ``model`` names the queue (workers started with ``--model`` of the same string pull it); without
    it, the first line's ``model`` (or "default") does, and lines naming another model are rejected.
    ``endpoint`` (OpenAI's batch endpoint) defaults to the URL of the first job's kind.
    ``on_complete`` (a Celery signature as a dict) is sent once when the batch ends (store.retire_batch).
    ``line_errors`` are lines a caller's own checks refused (the API's upload limits): recorded, not parsed.
    ``dataset``: the source and row flags the lines were rendered from (``jobs/datasets/queue.py`` alone
    passes it; the API never does, so a client cannot make ``sluice results`` read a source of its choosing).
    ``plan``: each chunk's jobs are handed out grouped by shared prompt prefix (jobs/prefix_plan.py), not
    in line order.
    """
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be between {-MAX_PRIORITY} and {MAX_PRIORITY}")
    r = r or connect()
    sub = _Submission(r, batch_id or keys.new_batch_id(), model, defaults, priority, chunk)
    sub.endpoint, sub.plan = endpoint, plan
    with refused_when_full(NOTHING_QUEUED, sub.abandon):
        sub.create(completion_window, metadata, input_name, on_complete, dataset)
        refused = {e.line: e for e in line_errors}
        for line_no, text in enumerate(lines, 1):
            if line_no in refused:
                sub.reject(refused[line_no])
            elif text.strip():
                sub.add(line_no, text)
            due = sub.pending >= chunk or (sub.pending and time.time() - sub.flushed_at > FLUSH_EVERY)
            if due and not sub.flush():
                break  # cancelled while validating
        sub.flush()
        sub.wait()
        return sub.finalize()


class UnknownModel(ValueError):
    pass


def resolve_model(r: redis.Redis, model: str | None) -> str:
    """The queue a batch asking for ``model`` goes to.

    Omitted or "default": the "default" queue, unless live workers serve exactly one other model and
    none serves "default" (so a laptop's one worker answers requests that name no model). Another
    name must be a queue some live worker serves (UnknownModel otherwise), except while no worker is
    live at all: then nothing can be checked, and the jobs wait for a worker of that name.
    """
    served = served_queues(r)
    if model is None or keys.queue_name(model) == "default":
        return next(iter(served)) if len(served) == 1 and "default" not in served else "default"
    queue = keys.queue_name(model)
    if served and queue not in served:
        raise UnknownModel(f"no worker serves model {model!r} (served: {', '.join(sorted(served))})")
    return queue


class _Submission:
    """The state of one submission between pipeline flushes."""

    def __init__(self, r: redis.Redis, batch_id: str, model: str | None, defaults: SamplingParams | None,
                 priority: int, chunk: int) -> None:
        self.r = r
        self.scripts = Scripts(r)
        self.bid = keys.check_batch_id(batch_id)
        self.explicit_model = model is not None
        self.model = keys.queue_name(model) if model is not None else None
        self.defaults = defaults
        self.priority = priority
        self.now = time.time()
        self.total = 0
        self.invalid = 0
        self.seen: set[str] = set()
        self.streams: dict[int, str] = {}  # priority -> stream key, for streams already created
        self.new_streams: list[int] = []
        self.pipe = NodePipes(r)
        # One flush in flight while the next chunk is parsed: the server's work overlaps ours.
        self.sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-submit")
        self.inflight: Future[list[Any]] | None = None
        self.cancelled = False
        self.pending = 0
        self.chunks: dict[int, list[Any]] = {}  # priority -> [job JSON, custom_id, idx, ...]
        self.plan = False  # hand each chunk's jobs out by shared prefix
        self.plan_keys: dict[int, list[Any]] = {}  # priority -> each chunk job's prefix_plan.plan_key
        self.deadlines: dict[str, float] = {}
        self.errors: list[str] = []
        self.endpoint: str | None = None
        self.flushed_at = self.now
        self.max_deliveries: int | None = None  # the batch's own, from its metadata
        self.traced = Submitted()  # each buffered job's sluice.submit span (tracing on: jobs/tracing.py)

    def create(self, window: float, metadata: dict[str, str] | None, input_name: str | None,
               on_complete: dict[str, Any] | None = None, dataset: dict[str, Any] | None = None,
               events: bool = True) -> None:
        """``events``: its final transition is recorded as an event for webhooks (not for online requests)."""
        if (metadata or {}).get(MAX_DELIVERIES_KEY) is not None:
            self.max_deliveries = parse_max_deliveries((metadata or {})[MAX_DELIVERIES_KEY])
        fields: dict[str, Any] = {
            "id": self.bid, "status": "validating", "model": self.model or "", "priority": self.priority,
            "created_at": self.now, "expires_at": self.now + window, "metadata": json.dumps(metadata or {}),
            "input": input_name or "", "total": 0, "completed": 0, "failed": 0, "cancelled": 0, "expired": 0,
            "invalid": 0, "priorities": "", "sealed": 0, "endpoint": self.endpoint or "", "touched_at": self.now,
            "events": int(events),
        }
        if on_complete is not None:  # with the batch from the start: it may end before submit returns
            fields["on_complete"] = json.dumps(on_complete)
        if dataset is not None:
            fields["dataset"] = json.dumps(dataset, ensure_ascii=False, separators=(",", ":"))
        if self.r.exists(keys.meta(self.bid)):
            raise ValueError(f"batch {self.bid} already exists")
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(keys.meta(self.bid), mapping=fields)
        pipe.zadd(keys.all_batches(), {self.bid: self.now})
        pipe.zadd(keys.open_batches(), {self.bid: self.now})
        pipe.execute()

    def add(self, line_no: int, text: str) -> None:
        try:
            job = parse_line(text, line_no, self.defaults, batch_id=self.bid, idx=self.total, created_at=self.now)
            self._check(job)
        except LineError as e:
            self.reject(e.info())
            return
        self.seen.add(job.custom_id)
        if self.endpoint is None:
            self.endpoint = {"chat": CHAT_URL, "embedding": EMBEDDINGS_URL, **KIND_URLS}.get(job.kind, COMPLETIONS_URL)
            self.r.hset(keys.meta(self.bid), "endpoint", self.endpoint)
        if "priority" not in job.model_fields_set:
            job.priority = self.priority
        job.max_deliveries = self.max_deliveries
        self._enqueue(job)

    def _check(self, job: Job) -> None:
        if job.custom_id in self.seen:
            raise LineError(job.line, "duplicate_custom_id", f"custom_id {job.custom_id!r} appears twice")
        wanted = None if job.model is None else self.model if job.model == self.model else keys.queue_name(job.model)
        if self.model is None:
            self.model = keys.queue_name(wanted)
            self.r.hset(keys.meta(self.bid), "model", self.model)
        elif wanted is not None and wanted != self.model and not self.explicit_model:
            raise LineError(job.line, "model_mismatch", f"model {job.model!r} differs from the batch's {self.model!r}")

    def reject(self, info: LineErrorInfo) -> None:
        self.invalid += 1
        self.errors.append(info.model_dump_json())

    def _enqueue(self, job: Job) -> None:
        stream = self.streams.get(job.priority)
        if stream is None:
            stream = self.streams[job.priority] = keys.jobs(self.bid, job.priority)
            # From id 0, so the group sees entries whatever the order the pipeline lands in.
            self.pipe.on(stream).xgroup_create(stream, keys.GROUP, id="0", mkstream=True)
            self.new_streams.append(job.priority)
        job.traceparent = self.traced.start(job.id, self.bid, job.custom_id, self.now)
        self.chunks.setdefault(job.priority, []).extend((job.model_dump_json(exclude_none=True), job.custom_id,
                                                         job.idx))
        if self.plan:
            self.plan_keys.setdefault(job.priority, []).append(plan_key(job))
        if job.deadline is not None:
            self.deadlines[str(job.idx)] = job.deadline
        self.total += 1
        self.pending += 1

    def flush(self) -> bool:
        """Send what is buffered; False when the batch was cancelled meanwhile."""
        p, bid = self.pipe, self.bid
        self.pipe = NodePipes(self.r)
        sent = list(self.chunks)
        for prio, args in self.chunks.items():
            enqueue(self.scripts, bid, self.streams[prio], self._planned(prio, args), p.on(self.streams[prio]))
        if self.deadlines:
            p.on(keys.deadlines(bid)).zadd(keys.deadlines(bid), self.deadlines)
        if self.errors:
            p.on(keys.line_errors(bid)).rpush(keys.line_errors(bid), *self.errors)
        self.flushed_at = time.time()
        meta: dict[str, float | str] = {"total": self.total, "invalid": self.invalid, "touched_at": self.flushed_at}
        if self.new_streams:
            meta["priorities"] = ",".join(str(x) for x in self.streams)
        p.on(keys.meta(bid)).hset(keys.meta(bid), mapping=meta)
        p.on(keys.meta(bid)).hget(keys.meta(bid), "status")
        # The queue's indexes after the batch's own writes (on a cluster, other nodes: a second round),
        # so a reader that just parked a stream sees it again.
        queue = keys.queue_name(self.model)
        index = self.r.pipeline(transaction=False)
        for prio in self.new_streams:
            index.zadd(keys.active_streams(queue), {self.streams[prio]: keys.stream_score(prio, self.now)})
        for prio in sent:
            mark_ready(index, queue, self.streams[prio], keys.stream_score(prio, self.now))
        self.pending = 0
        self.chunks, self.deadlines, self.errors, self.new_streams, self.plan_keys = {}, {}, [], [], {}
        self.wait()
        self.inflight = self.sender.submit(_send, p, index, self.traced.take())
        return not self.cancelled

    def _planned(self, prio: int, args: list[Any]) -> list[Any]:
        """A chunk's (job JSON, custom_id, idx) triples in hand-out order, each with its prefix group."""
        n = len(args) // 3
        if not self.plan:
            return [x for i in range(n) for x in (*args[3 * i : 3 * i + 3], "")]
        order = sorted(range(n), key=self.plan_keys[prio].__getitem__)
        group = groups([self.plan_keys[prio][i][2] for i in order])
        return [x for i, g in zip(order, group, strict=True) for x in (*args[3 * i : 3 * i + 3], g)]

    def wait(self) -> None:
        """Wait for the flush in flight; note a cancel that came while validating."""
        if self.inflight is not None:
            self.cancelled = self.inflight.result()[-1] != "validating"
            self.inflight = None

    def finalize(self) -> Batch:
        self.sender.shutdown()
        seal(self.r, self.scripts, self.bid, time.time())
        batch = get_batch(self.r, self.bid)
        assert batch is not None
        return batch

    def abandon(self) -> None:
        """Redis is full: take back what was written (deletes free memory; they are allowed when full)."""
        self.sender.shutdown(wait=True, cancel_futures=True)
        try:
            delete_batch(self.r, self.bid)
        except redis.RedisError:
            pass  # housekeeping fails a batch whose submitter is gone


def _send(batch: NodePipes, index: Any, traced: Submitted) -> list[Any]:
    """One flush: the batch's writes, then the queue's indexes; the first error reply is raised."""
    start = time.time()
    replies = batch.execute()
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    index.execute()
    traced.enqueued(start, time.time())
    return replies


def seal(r: redis.Redis, scripts: Scripts, batch_id: str, now: float, reason: str = "") -> None:
    """The batch's total is final: it may finish now. By its submitter after the last line, or by
    housekeeping for a submitter that died (``reason`` then says so)."""
    r.hset(keys.meta(batch_id), "sealed", 1)
    total = int(r.hget(keys.meta(batch_id), "total") or 0)
    if reason:
        r.hset(keys.meta(batch_id), "seal_reason", reason)
    if total == 0:
        old = transition(scripts, batch_id, "failed", "failed_at", now, ("validating",))
        if old in ("validating", "cancelling"):
            if old == "cancelling":
                transition(scripts, batch_id, "cancelled", "cancelled_at", now, ("cancelling",))
            retire_batch(r, batch_id, now)
        return
    transition(scripts, batch_id, "in_progress", "in_progress_at", now, ("validating",))
    if finish(scripts, batch_id, now):
        retire_batch(r, batch_id, now)  # workers were faster than the last flush
    _finish_cancel(r, scripts, batch_id, total, now)


def _finish_cancel(r: redis.Redis, scripts: Scripts, batch_id: str, total: int, now: float) -> None:
    """A cancel that came while validating saw only part of the jobs: sweep them all now."""
    if r.hget(keys.meta(batch_id), "status") != "cancelling":
        return
    sweep_all(r, scripts, batch_id, total, "cancelled", "batch_cancelled", "the batch was cancelled")


def submit_job(r: redis.Redis, job: Job, queue: str, *, batch_id: str, priority: int,
               metadata: dict[str, str] | None = None, completion_window: float = DEFAULT_WINDOW) -> Batch:
    """Queue one already parsed Job as a one-job batch ``batch_id`` on ``queue`` at ``priority`` (the
    API's interactive requests: their Job carries fields no input line spells, such as ``stream``)."""
    if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be between {-MAX_PRIORITY} and {MAX_PRIORITY}")
    sub = _Submission(r, batch_id, queue, None, priority, CHUNK)
    sub.endpoint = CHAT_URL if job.kind == "chat" else COMPLETIONS_URL
    with refused_when_full(NOTHING_QUEUED, sub.abandon):
        sub.create(completion_window, metadata, None, events=False)
        sub._enqueue(job.model_copy(update={"id": f"{sub.bid}:0", "batch_id": sub.bid, "idx": 0, "priority": priority,
                                            "created_at": sub.now}))
        sub.flush()
        sub.wait()
        return sub.finalize()
