"""The consumer side of the job protocol: what a worker reads and writes in Redis.

Reading new jobs from the ready set, claiming the pending jobs of dead workers, recording an outcome,
putting a job back, counting a failed attempt, the heartbeat, and the cancel feed: every stream field,
KEYS list and script call a worker uses is spelled here, beside the scripts (jobs/scripts.py) and
keys (jobs/keys.py) it uses. ``worker/`` drives this module and knows no key names.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Literal

import redis
from pydantic import ValidationError
from sluice.jobs import keys
from sluice.jobs import scripts as script
from sluice.jobs.full import is_full
from sluice.jobs.pipes import NodePipes
from sluice.jobs.schemas import Job, WorkerHeartbeat
from sluice.jobs.scripts import Scripts

log = logging.getLogger(__name__)

MAX_STREAMS = 256  # ready streams looked at per read, best score first
# Prefix-group affinity (issue 44; scripts.PULL): a group's owner is live while it read its batch within
# QUIET_S seconds (a worker whose engine is full does not read: its groups are then split, it cannot keep
# up); at most HANDOFF_MAX jobs wait handed to one owner, and one read hands at most HAND_MOST along.
QUIET_S = 5.0
HANDOFF_MAX = 64
HAND_MOST = 256


@dataclass
class Delivery:
    job: Job
    stream: str
    entry_id: str
    deliveries: int  # times this job was handed to a worker, this time included
    sick_episodes: int = 0  # times an engine went sick while a worker held it: it runs alone (screen sets it)

    @property
    def batch_id(self) -> str:
        return self.job.batch_id or ""  # a queued job always has one (jobs/submit.py)


@dataclass
class Unreadable:
    """A stream entry that is not a valid job: it gets a failed outcome, so its batch can finish."""

    batch_id: str
    idx: int | None  # None: not even the job index could be read (the entry is only dropped)
    stream: str
    entry_id: str
    reason: str


@dataclass
class Pulled:
    deliveries: list[Delivery]
    unreadable: list[Unreadable]
    handed: int = 0  # jobs of the streams read that wait handed to a group's owner (ours or another's)


@dataclass
class Outcome:
    batch_id: str
    idx: int
    status: str  # completed | failed | cancelled | expired
    result_json: str
    stream: str = ""  # the job stream entry to acknowledge ("" for none)
    entry_id: str = ""
    dead_json: str = ""  # set for a dead-lettered job
    stands_in: bool = False  # a failed outcome written in place of one the server refused: never replaced again


@dataclass
class CancelEvent:
    batch_id: str
    idx: int | None  # None: the whole batch
    status: str  # the outcome its held jobs get: cancelled | expired

    def reason(self) -> tuple[str, str]:
        """The error (code, message) of the held jobs it settles."""
        one = self.idx is not None
        code = "batch_expired" if self.status == "expired" else ("cancelled" if one else "batch_cancelled")
        return code, f"the {'job' if one else 'batch'} was {self.status}"


# ---- new jobs ------------------------------------------------------------------------------------
def ready(r: redis.Redis, queue: str) -> list[tuple[str, float]]:
    """The best-scored ready streams of a queue, with their scores."""
    return [(s, float(score)) for s, score in r.zrange(keys.ready_streams(queue), 0, MAX_STREAMS - 1, withscores=True)]


def read(r: redis.Redis, queue: str, consumer: str, n: int, streams: list[tuple[str, float]],
         scripts: Scripts | None = None, turn: int = 0) -> Pulled:
    """Up to ``n`` jobs never delivered before: the open batches of the best priority share them (``_shares``),
    then any stream gives what is left, best first. A stream found drained leaves the ready set and is read
    once more: a job added before that second read is returned (and the stream goes back), one added after
    it comes with the writer's own ZADD (``mark_ready``). A paused batch's stream hands out nothing
    (``scripts.pull`` checks the pause in the read) and leaves the ready set."""
    s = scripts or Scripts(r)
    out = Pulled([], [])
    dry: set[str] = set()  # drained or paused in this read
    for stream, score, cap in _shares(streams, n, turn):
        want = min(cap, n - len(out.deliveries))
        if want <= 0:
            break
        if stream in dry:
            continue
        got = _xread(s, consumer, stream, want)
        if got is None:
            dry.add(stream)
            _unready_paused(r, queue, stream, score)
            continue
        entries, waiting = got
        out.handed += waiting
        if len(entries) < want:
            dry.add(stream)
            if not waiting:  # jobs handed to a group's owner keep the stream in view until taken
                r.zrem(keys.ready_streams(queue), stream)
                again = _xread(s, consumer, stream, want - len(entries))
                if again and (again[0] or again[1]):
                    r.zadd(keys.ready_streams(queue), {stream: score})
                entries += again[0] if again else []
        for eid, fields in entries:
            _parse(stream, eid, fields, 1, out)
    return out


def _shares(streams: list[tuple[str, float]], n: int, turn: int) -> list[tuple[str, float, int]]:
    """Fair share (issue 43): the streams of the best priority (open batches, oldest first by score) each
    give at most an equal part of ``n``, starting ``turn`` places along, so a small batch queued behind a
    huge one gets jobs on every read instead of after it; then every stream, best first, what is left."""
    if not streams:
        return []
    band = _band(streams[0][1])
    top = [(st, sc) for st, sc in streams if _band(sc) == band]
    start = turn % len(top)
    quota = -(-n // len(top))
    return [(st, sc, quota) for st, sc in top[start:] + top[:start]] + [(st, sc, n) for st, sc in streams]


def _band(score: float) -> int:
    """The priority a ready stream's score holds (keys.stream_score: -priority * 1e10 + created_at)."""
    return math.floor(score / 1e10)


def _xread(s: Scripts, consumer: str, stream: str, n: int) -> tuple[list[tuple[str, dict[str, str]]], int] | None:
    """Entries of ``stream`` for us (new ones, or handed to us by prefix group) and how many jobs wait
    handed to a group's owner; None if its batch is paused."""
    got = script.pull(s, stream, consumer, n, time.time(), QUIET_S, HANDOFF_MAX, HAND_MOST)
    return None if got is None else ([(eid, _fields(flat)) for eid, flat in got[0]], got[1])


def _fields(flat: list[str] | None) -> dict[str, str]:
    """A stream entry's [field, value, ...] as a script returns it."""
    flat = flat or []
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _unready_paused(r: redis.Redis, queue: str, stream: str, score: float) -> None:
    """A paused batch's stream out of the ready set, so readers stop looking at it; back at once if a
    resume came in between (its own ZADD may have run before our ZREM)."""
    r.zrem(keys.ready_streams(queue), stream)
    if not r.hexists(keys.meta(keys.parse_jobs_key(stream)[0]), "paused_at"):
        r.zadd(keys.ready_streams(queue), {stream: score})


def mark_ready(pipe: Any, queue: str, stream: str, score: float) -> None:
    """After adding entries to ``stream``: readers look at it again."""
    pipe.zadd(keys.ready_streams(queue), {stream: score})


def restore_ready(r: redis.Redis, queue: str, batch_id: str, priorities: list[int], created_at: float) -> int:
    """Put back in the ready set the streams of an open batch that hold undelivered jobs (their ZADD
    was refused while Redis was full, or lost with the last second of AOF). Housekeeping runs it.
    Acknowledged entries are deleted, so a stream longer than its pending list has undelivered ones."""
    streams = [keys.jobs(batch_id, p) for p in priorities]
    pipe = r.pipeline(transaction=False)
    for s in streams:
        pipe.xlen(s)
        pipe.xpending(s, keys.GROUP)
    got = pipe.execute(raise_on_error=False)
    back = {}
    for i, (p, s) in enumerate(zip(priorities, streams, strict=True)):
        length, summary = got[2 * i], got[2 * i + 1]
        if isinstance(length, int) and isinstance(summary, dict) and length > int(summary.get("pending") or 0):
            back[s] = keys.stream_score(p, created_at)
    return r.zadd(keys.ready_streams(queue), back, nx=True) if back else 0


def job_score(job: Job) -> float:
    return keys.stream_score(job.priority, job.created_at)


# ---- orphans -------------------------------------------------------------------------------------
def claim(r: redis.Redis, queue: str, consumer: str, n: int, held: set[str], scripts: Scripts | None = None) -> Pulled:
    """Up to ``n`` pending jobs of workers whose heartbeat is gone (not merely idle: a long generation
    looks idle), and our own that we do not hold (left from before a restart). Walks every stream of
    the queue's open batches, not only the ready ones: a drained stream can still have pending jobs.
    A paused batch's are left where they are until it is resumed (``scripts.claim`` checks the pause)."""
    sc = scripts or Scripts(r)
    out = Pulled([], [])
    streams = r.zrange(keys.active_streams(queue), 0, -1)
    if not streams or n <= 0:
        return out
    pipe = r.pipeline(transaction=False)
    for s in streams:
        pipe.xpending(s, keys.GROUP)
    summaries = pipe.execute(raise_on_error=False)
    owners = {c["name"] for sm in summaries if isinstance(sm, dict) for c in sm.get("consumers") or []}
    owners.discard(consumer)
    names = sorted(owners)
    alive = dict(zip(names, _alive(r, names), strict=True)) if names else {}
    for stream, sm in zip(streams, summaries, strict=True):
        if not isinstance(sm, dict) or not sm.get("pending"):
            continue
        for c in sm.get("consumers") or []:
            name = c["name"]
            if name == consumer or not alive.get(name, False):
                # what this pass already claimed is pending under us too, and not to be claimed twice
                taken = held | {d.entry_id for d in out.deliveries}
                _claim_from(r, sc, stream, consumer, name, n - len(out.deliveries), taken, out)
            if len(out.deliveries) >= n:
                return out
    return out


def _alive(r: redis.Redis, names: list[str]) -> list[bool]:
    pipe = r.pipeline(transaction=False)
    for c in names:
        pipe.exists(keys.heartbeat(c))
    return [bool(x) for x in pipe.execute()]


def _claim_from(r: redis.Redis, s: Scripts, stream: str, consumer: str, owner: str, n: int, held: set[str],
                out: Pulled) -> None:
    if n <= 0:
        return
    pending = [p for p in r.xpending_range(stream, keys.GROUP, "-", "+", n + len(held), consumername=owner)
               if p["message_id"] not in held][:n]
    if not pending:
        return
    # XCLAIM with the smallest idle time seen is a compare-and-set: an entry someone else claimed
    # in between has a smaller idle time now and is left alone.
    min_idle = min(p["time_since_delivered"] for p in pending)
    counts = {p["message_id"]: p["times_delivered"] + 1 for p in pending}
    claimed = script.claim(s, stream, consumer, min_idle, owner, [p["message_id"] for p in pending])
    before = len(out.deliveries)
    for eid, flat in claimed:
        if flat:  # none: the entry was deleted meanwhile
            _parse(stream, eid, _fields(flat), counts[eid], out)
    if len(out.deliveries) > before:
        log.info("claimed %d jobs of %s from %s", len(out.deliveries) - before, owner, stream)


def _parse(stream: str, entry_id: str, fields: dict[str, str], count: int, out: Pulled) -> None:
    try:
        job = Job.model_validate_json(fields["j"])
    except (KeyError, ValidationError) as e:
        batch_id, _ = keys.parse_jobs_key(stream)
        out.unreadable.append(Unreadable(batch_id, _idx_of(fields.get("j")), stream, entry_id,
                                         f"the queued job could not be read: {e}"))
        return
    out.deliveries.append(Delivery(job, stream, entry_id, count + int(fields.get("a") or 0)))


def _idx_of(raw: str | None) -> int | None:
    try:
        idx = json.loads(raw or "").get("idx")
    except (ValueError, AttributeError):
        return None
    return idx if isinstance(idx, int) and not isinstance(idx, bool) and idx >= 0 else None


def drop(r: redis.Redis, u: Unreadable) -> None:
    """An unreadable entry with no job index: nothing to record an outcome under."""
    log.error("dropping unreadable entry %s in %s: %s", u.entry_id, u.stream, u.reason)
    r.xack(u.stream, keys.GROUP, u.entry_id)
    r.xdel(u.stream, u.entry_id)


# ---- outcomes and attempts -----------------------------------------------------------------------
def record(scripts: Scripts, pipes: NodePipes, o: Outcome, now: float) -> None:
    """Queue on ``pipes`` the atomic write of one outcome; its reply is ``[fresh, final status or '']``."""
    script.record(scripts, o.batch_id, o.idx, o.status, o.result_json, o.stream, o.entry_id, o.dead_json, now,
                  pipes.on(keys.meta(o.batch_id)))


def batch_exists(r: redis.Redis, batch_id: str) -> bool:
    return bool(r.exists(keys.meta(batch_id)))


def note_error(r: redis.Redis, d: Delivery, message: str) -> None:
    """The last error of a job, for its dead letter if another worker gives up on it."""
    r.hset(keys.last_errors(d.batch_id), d.job.idx, message)


def note_sick(r: redis.Redis, ds: list[Delivery]) -> None:
    """One more sick episode (the engine failed even a probe) for each of these held jobs."""
    pipe = r.pipeline(transaction=False)
    for d in ds:
        pipe.hincrby(keys.sick_episodes(d.batch_id), str(d.job.idx), 1)
    pipe.execute()


def count_attempt(r: redis.Redis, scripts: Scripts, d: Delivery, consumer: str) -> bool:
    """Count one more delivery of a job we still hold, in Redis, so the tally survives our crash.
    False if the job is no longer pending under us (another worker took it: fencing)."""
    return script.bump(scripts, d.stream, d.entry_id, consumer)


def requeue(r: redis.Redis, scripts: Scripts, ds: list[Delivery], consumer: str, queue: str) -> None:
    """Hand jobs we hold back to the queue (at the end of their streams), without counting the delivery.
    Fenced: a job no longer pending under ``consumer`` is left to whoever has it. The streams go back
    into the ready set after their XADDs (on a cluster they may be on other nodes: a second round)."""
    back, ready = NodePipes(r), NodePipes(r)
    for d in ds:
        script.requeue(scripts, d.stream, d.entry_id, d.job.model_dump_json(exclude_none=True), d.deliveries - 1,
                       consumer, back.on(d.stream))
        mark_ready(ready.on(keys.ready_streams(queue)), queue, d.stream, job_score(d.job))
    for reply in [*back.execute(), *ready.execute()]:
        if isinstance(reply, Exception):
            raise reply


def still_held(r: redis.Redis, consumer: str, ds: list[Delivery]) -> list[bool]:
    """For each delivery, whether its entry is still pending under ``consumer`` (after our heartbeat
    lapsed, another worker may have claimed it)."""
    pipe = r.pipeline(transaction=False)
    for d in ds:
        pipe.xpending_range(d.stream, keys.GROUP, d.entry_id, d.entry_id, 1, consumername=consumer)
    return [isinstance(x, list) and len(x) == 1 for x in pipe.execute(raise_on_error=False)]


def screen(r: redis.Redis, ds: list[Delivery]) -> list[tuple[bool, str | None, str | None]]:
    """For each delivery: (has its outcome, batch status or None if gone, last error); sets its
    ``sick_episodes``. Takes the jobs out of the deadline set: started now, housekeeping may no longer
    expire them."""
    pipe = r.pipeline(transaction=False)
    for d in ds:
        bid, idx = d.batch_id, d.job.idx
        pipe.hexists(keys.done(bid), idx)
        pipe.hget(keys.meta(bid), "status")
        pipe.zrem(keys.deadlines(bid), idx)
        pipe.hget(keys.last_errors(bid), idx)
        pipe.hget(keys.sick_episodes(bid), idx)
    replies = pipe.execute()
    for i, d in enumerate(ds):
        d.sick_episodes = int(replies[5 * i + 4] or 0)
    return [(bool(replies[5 * i]), replies[5 * i + 1], replies[5 * i + 3]) for i in range(len(ds))]


# ---- heartbeat -----------------------------------------------------------------------------------
def claim_identity(r: redis.Redis, worker_id: str, payload: str, ttl_ms: int) -> bool:
    return bool(r.set(keys.heartbeat(worker_id), payload, nx=True, px=ttl_ms))


def identity_holder(r: redis.Redis, worker_id: str) -> WorkerHeartbeat | None:
    return WorkerHeartbeat.read(r.get(keys.heartbeat(worker_id)))


Beat = Literal["renewed", "kept", "lapsed"]


def beat(r: redis.Redis, worker_id: str, payload: str, ttl_ms: int) -> Beat:
    """Renew the heartbeat: "renewed"; "lapsed" when it had lapsed (other workers may have claimed our
    jobs; it is set again if the server has room). On a full server, which refuses the SET, "kept": the
    TTL alone is renewed (PEXPIRE needs no memory), so a live worker keeps its jobs while the payload
    goes stale."""
    key = keys.heartbeat(worker_id)
    try:
        if r.set(key, payload, xx=True, px=ttl_ms):
            return "renewed"
    except redis.ResponseError as e:
        if not is_full(e):
            raise
        if r.pexpire(key, ttl_ms):
            return "kept"
        return "lapsed"
    try:
        r.set(key, payload, px=ttl_ms)
    except redis.ResponseError as e:
        if not is_full(e):
            raise
    return "lapsed"


def take_over(r: redis.Redis, worker_id: str, payload: str, ttl_ms: int) -> None:
    r.set(keys.heartbeat(worker_id), payload, px=ttl_ms)


def sign_off(r: redis.Redis, worker_id: str) -> None:
    """Gone at once, so other workers may claim what we still held without waiting out the TTL."""
    r.delete(keys.heartbeat(worker_id))


# ---- cancel feed ---------------------------------------------------------------------------------
def publish_cancel(r: redis.Redis, queue: str, batch_id: str, idx: int | str | None, status: str) -> None:
    """Tell a queue's workers to abort a batch's (or one job's) held jobs, settling them ``status``."""
    r.xadd(keys.cancels(queue), {"b": batch_id, "i": "" if idx is None else str(idx), "s": status},
           maxlen=10_000, approximate=True)


def cancel_cursor(r: redis.Redis, queue: str) -> str:
    last = r.xrevrange(keys.cancels(queue), count=1)
    return last[0][0] if last else "0-0"


def read_cancels(r: redis.Redis, queue: str, cursor: str, block_ms: int) -> tuple[str, list[CancelEvent]]:
    """Cancel events after ``cursor``, waiting up to ``block_ms``; (new cursor, events)."""
    got = r.xread({keys.cancels(queue): cursor}, count=256, block=block_ms)
    events = []
    for _, entries in got or []:
        for eid, f in entries:
            cursor = eid
            idx = f.get("i") or ""
            events.append(CancelEvent(f["b"], int(idx) if idx else None, f.get("s") or "cancelled"))
    return cursor, events
