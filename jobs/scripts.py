"""The job plane's atomic writes, as Lua scripts, each followed by the one typed function that spells
its KEYS and ARGV. Each touches only keys of one batch (one hash tag).

The invariant they keep: a job gets exactly one outcome. ``done`` (job idx -> results entry) is
checked first in every write, so a redelivered job, a cancel racing a completion, or a retried
write after a lost reply never overwrites a result nor counts it twice.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.commands.core import Script
from sluice.jobs import keys
from sluice.jobs.schemas import ErrorInfo, Result, ResultTimings


class Scripts:
    """Runs the scripts below on one client (redis-py loads one again after a server restart or flush)."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r
        self._loaded: dict[str, Script] = {}

    def run(self, lua: str, ks: list[str], args: list[Any], client: Any = None) -> Any:
        script = self._loaded.get(lua)
        if script is None:  # register_script only hashes the text: no round trip
            script = self._loaded[lua] = self.r.register_script(lua)
        return script(keys=ks, args=args, client=client)


# A batch's terminal transition, recorded in the same script as its event (batch.completed, ...) for the
# webhook deliverer (jobs/webhooks.py); only batches submitted as batches (meta ``events``), not online requests.
_EVENT = """
local function batch_event(meta, events, status, now)
  if redis.call('HGET', meta, 'events') == '1' then
    redis.call('XADD', events, '*', 't', 'batch.' .. status, 'at', now)
  end
end
"""

# Moves a batch to its final state once every job has an outcome; shared by the scripts below.
_FINISH = _EVENT + """
local function finish_if_done(meta, events, now)
  local m = redis.call('HMGET', meta, 'status', 'total', 'completed', 'failed', 'cancelled', 'expired', 'sealed')
  local total = tonumber(m[2]) or 0
  local n = (tonumber(m[3]) or 0) + (tonumber(m[4]) or 0) + (tonumber(m[5]) or 0) + (tonumber(m[6]) or 0)
  -- Not before the last line is in: until then the total still grows.
  if m[7] ~= '1' or total == 0 or n < total then return '' end
  if m[1] == 'in_progress' then
    redis.call('HSET', meta, 'status', 'completed', 'finalizing_at', now, 'completed_at', now)
    batch_event(meta, events, 'completed', now)
    return 'completed'
  elseif m[1] == 'cancelling' then
    redis.call('HSET', meta, 'status', 'cancelled', 'cancelled_at', now)
    batch_event(meta, events, 'cancelled', now)
    return 'cancelled'
  elseif m[1] == 'expired' then
    return 'expired'
  end
  return ''
end
"""

# KEYS: meta, done, results, jobs stream (or meta when nothing to ack), dead, inputs, events
# ARGV: idx, status, Result JSON (the usage decoded from it), stream entry id to ack ('' for none),
#       DeadLetter JSON ('' for none), now, group
# -> {1 if this write gave the job its outcome else 0, final batch status reached or ''}
# A failed or expired job's input is kept (inputs: "<status> <job JSON>") before its entry goes, for a retry.
# A batch deleted meanwhile (a Celery generate drops its own once read) gets nothing written back,
# so a write retried after a lost reply cannot leave stray keys.
RECORD = _FINISH + """
local fresh = 0
local fin = ''
if redis.call('EXISTS', KEYS[1]) == 1 and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then
  local rid = redis.call('XADD', KEYS[3], '*', 'i', ARGV[1], 'r', ARGV[3])
  redis.call('HSET', KEYS[2], ARGV[1], rid)
  redis.call('HINCRBY', KEYS[1], ARGV[2], 1)
  if ARGV[2] == 'completed' then  -- the batch's token usage, summed as results land
    local ok, res = pcall(cjson.decode, ARGV[3])
    if ok and type(res) == 'table' and type(res.usage) == 'table' then
      for _, k in ipairs({'prompt_tokens', 'completion_tokens', 'cached_tokens', 'reasoning_tokens'}) do
        redis.call('HINCRBY', KEYS[1], k, tonumber(res.usage[k]) or 0)
      end
    end
  end
  if ARGV[5] ~= '' then
    redis.call('XADD', KEYS[5], '*', 'i', ARGV[1], 'd', ARGV[5])
  end
  if ARGV[4] ~= '' and (ARGV[2] == 'failed' or ARGV[2] == 'expired') then
    local e = redis.call('XRANGE', KEYS[4], ARGV[4], ARGV[4])
    if e[1] then
      local f = e[1][2]
      for k = 1, #f, 2 do
        if f[k] == 'j' then redis.call('HSET', KEYS[6], ARGV[1], ARGV[2] .. ' ' .. f[k + 1]) end
      end
    end
  end
  fresh = 1
  fin = finish_if_done(KEYS[1], KEYS[7], ARGV[6])
end
if ARGV[4] ~= '' then
  redis.call('XACK', KEYS[4], ARGV[7], ARGV[4])
  redis.call('XDEL', KEYS[4], ARGV[4])
end
return {fresh, fin}
"""


def record(s: Scripts, batch_id: str, idx: int, status: str, result_json: str, stream: str, entry_id: str,
           dead_json: str, now: float, client: Any = None) -> Any:
    """The atomic write of one outcome (``stream``/``entry_id`` "" for no entry to acknowledge); its
    reply, on ``client`` (a pipeline) or at once, is ``[fresh, final status or '']``."""
    ks = [keys.meta(batch_id), keys.done(batch_id), keys.results(batch_id), stream or keys.meta(batch_id),
          keys.dead(batch_id), keys.inputs(batch_id), keys.events(batch_id)]
    return s.run(RECORD, ks, [idx, status, result_json, entry_id, dead_json, now, keys.GROUP], client)

# The outcome of a job that has none yet (cancel, expiry), as Python built it: no worker holds its Result.
_OUTCOME = """
local function bare_outcome(meta, done, results, idx, status, result, now)
  if redis.call('HEXISTS', done, idx) == 1 then return 0 end
  local rid = redis.call('XADD', results, '*', 'i', idx, 'r', result)
  redis.call('HSET', done, idx, rid)
  redis.call('HINCRBY', meta, status, 1)
  return 1
end
"""


def _bare_results(s: Scripts, batch_id: str, idxs: list[int], status: str, code: str, message: str,
                  now: float) -> list[str | int]:
    """(idx, Result JSON) per job, flat. Its custom_id is read first: it never changes once queued."""
    cids = s.r.hmget(keys.job_custom_ids(batch_id), idxs) if idxs else []
    out: list[str | int] = []
    for idx, cid in zip(idxs, cids, strict=True):
        res = Result(job_id=f"{batch_id}:{idx}", custom_id=cid or "", batch_id=batch_id, idx=idx, status=status,
                     error=ErrorInfo(code=code, message=message), timings=ResultTimings(finished=now))
        out += [idx, res.model_dump_json(exclude_none=True)]
    return out


# Gives every listed job that has no outcome yet the outcome ARGV[1] (cancelled | expired).
# KEYS: meta, done, results, events
# ARGV: status, now, (idx, Result JSON)...
# -> {number of outcomes written, final batch status reached or ''}
SWEEP = _FINISH + _OUTCOME + """
local written = 0
for i = 3, #ARGV, 2 do
  written = written + bare_outcome(KEYS[1], KEYS[2], KEYS[3], ARGV[i], ARGV[1], ARGV[i + 1], ARGV[2])
end
return {written, finish_if_done(KEYS[1], KEYS[4], ARGV[2])}
"""


def sweep(s: Scripts, batch_id: str, idxs: list[int], status: str, code: str, message: str, now: float,
          client: Any = None) -> tuple[int, str]:
    """Outcome ``status`` for each job of ``idxs`` that has none; (written, final status or '')."""
    ks = [keys.meta(batch_id), keys.done(batch_id), keys.results(batch_id), keys.events(batch_id)]
    args = [status, now, *_bare_results(s, batch_id, idxs, status, code, message, now)]
    written, fin = s.run(SWEEP, ks, args, client)
    return int(written), fin or ""

# Expires jobs whose deadline passed before any worker started them. A worker starting a job takes
# it out of ``deadlines`` first (ZREM), so a job is either started or expired, never both: a job
# listed here is expired only if this ZREM is the one that takes it out.
# KEYS: meta, done, results, deadlines, events
# ARGV: now, (idx, Result JSON)... -> {number expired, final batch status or ''}
EXPIRE_DUE = _FINISH + _OUTCOME + """
local written = 0
for i = 2, #ARGV, 2 do
  if redis.call('ZREM', KEYS[4], ARGV[i]) == 1 then
    written = written + bare_outcome(KEYS[1], KEYS[2], KEYS[3], ARGV[i], 'expired', ARGV[i + 1], ARGV[1])
  end
end
return {written, finish_if_done(KEYS[1], KEYS[5], ARGV[1])}
"""


def expire_due(s: Scripts, batch_id: str, now: float, limit: int) -> tuple[int, str, int]:
    """Expire up to ``limit`` jobs of the batch whose deadline passed; (expired, final status or '', due)."""
    due = [int(i) for i in s.r.zrangebyscore(keys.deadlines(batch_id), "-inf", now, start=0, num=limit)]
    ks = [keys.meta(batch_id), keys.done(batch_id), keys.results(batch_id), keys.deadlines(batch_id),
          keys.events(batch_id)]
    results = _bare_results(s, batch_id, due, "expired", "deadline_exceeded",
                            "the deadline passed before the job started", now)
    written, fin = s.run(EXPIRE_DUE, ks, [now, *results])
    return int(written), fin or "", len(due)

# Hands out up to ARGV[3] jobs of one stream unless its batch is paused (meta ``paused_at``): the check
# and the read in one script, so no job is handed out once a pause is recorded (jobs/pause.py).
# Affinity (issue 44): a new entry whose prefix group (field g) belongs to another live reader is handed
# to it (pending under it, listed in the handoff set) unless it already has ARGV[6] waiting: then the
# group is split, its owner cannot keep up. Jobs handed to us, or to a reader gone quiet for ARGV[5]
# seconds (busy or dead), are taken first. A reader is live while it read the batch within ARGV[5] s.
# A full server refuses the bookkeeping writes (pcall): the read goes on without affinity.
# KEYS: meta, stream, groups, readers, handoff; ARGV: group, consumer, count, now, quiet s, handoff max,
# most handed per call -> {0} if paused, else {1, entries (XREADGROUP's), jobs still waiting in handoff}
PULL = """
if redis.call('HEXISTS', KEYS[1], 'paused_at') == 1 then return {0} end
-- The batch was deleted since the list was read: write nothing (a readers hash would outlive it).
if redis.call('EXISTS', KEYS[2]) == 0 then return {1, {}, 0} end
local me, n, now, quiet = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
pcall(redis.call, 'HSET', KEYS[4], me, ARGV[4])  -- a full server refuses it: the read goes on
local function live(c)
  local t = tonumber(redis.call('HGET', KEYS[4], c))
  return t ~= nil and now - t < quiet
end
local out = {}
for _, m in ipairs(redis.call('ZRANGE', KEYS[5], 0, -1)) do
  if #out >= n then break end
  local tab = string.find(m, '\\t', 1, true)
  local owner, id = string.sub(m, 1, tab - 1), string.sub(m, tab + 1)
  if owner == me or not live(owner) then
    redis.call('ZREM', KEYS[5], m)
    if #redis.call('XPENDING', KEYS[2], ARGV[1], id, id, 1, owner) == 1 then
      if owner ~= me then redis.call('XCLAIM', KEYS[2], ARGV[1], me, 0, id, 'JUSTID') end
      local e = redis.call('XRANGE', KEYS[2], id, id)
      if #e == 1 then out[#out + 1] = e[1] end
    end
  end
end
local function group_of(fields)
  for i = 1, #fields, 2 do if fields[i] == 'g' then return fields[i + 1] end end
  return nil
end
local handed = 0
while #out < n and handed < tonumber(ARGV[7]) do
  local ok, got = pcall(redis.call, 'XREADGROUP', 'GROUP', ARGV[1], me, 'COUNT', n - #out, 'STREAMS', KEYS[2], '>')
  if not ok then return {1, out, 0} end  -- NOGROUP: the batch was deleted since the list was read
  if not got then break end
  for _, e in ipairs(got[1][2]) do
    local g = group_of(e[2])
    local owner = g and redis.call('HGET', KEYS[3], g)
    local theirs = owner and owner ~= me and live(owner)
    if theirs and redis.call('ZLEXCOUNT', KEYS[5], '[' .. owner .. '\\t', '[' .. owner .. '\\t\\255') < tonumber(ARGV[6])
        and pcall(redis.call, 'ZADD', KEYS[5], 0, owner .. '\\t' .. e[1]) then
      redis.call('XCLAIM', KEYS[2], ARGV[1], owner, 0, e[1], 'JUSTID')  -- JUSTID: not counted as a delivery
      handed = handed + 1
    else
      if g and not theirs then pcall(redis.call, 'HSET', KEYS[3], g, me) end
      out[#out + 1] = e
    end
  end
end
return {1, out, redis.call('ZCARD', KEYS[5])}
"""


def pull(s: Scripts, stream: str, consumer: str, n: int, now: float, quiet: float, handoff_max: int,
         hand_most: int) -> tuple[list[Any], int] | None:
    """Entries of ``stream`` for ``consumer`` (at most ``n``), [id, [field, value, ...]] each, and how many jobs
    wait in the stream's handoff set; None if its batch is paused."""
    batch_id, prio = keys.parse_jobs_key(stream)
    ks = [keys.meta(batch_id), stream, keys.groups(batch_id), keys.readers(batch_id), keys.handoff(batch_id, prio)]
    got = s.run(PULL, ks, [keys.GROUP, consumer, n, now, quiet, handoff_max, hand_most])
    return None if int(got[0]) == 0 else (list(got[1]), int(got[2]))


# Claims pending entries (XCLAIM with a minimum idle time) unless their batch is paused, atomically as PULL.
# An entry handed to its group's owner and not yet taken by it (in the handoff set) is the owner's to take
# through PULL: its owner's own claim leaves it; another's claim (the owner is dead) takes it off the set.
# KEYS: meta, stream, handoff; ARGV: group, consumer, min idle ms, their owner, entry id... -> XCLAIM's entries
CLAIM = """
if redis.call('HEXISTS', KEYS[1], 'paused_at') == 1 then return {} end
local ids = {}
for i = 5, #ARGV do
  local m = ARGV[4] .. '\\t' .. ARGV[i]
  if not redis.call('ZSCORE', KEYS[3], m) then
    ids[#ids + 1] = ARGV[i]
  elseif ARGV[4] ~= ARGV[2] then
    redis.call('ZREM', KEYS[3], m)
    ids[#ids + 1] = ARGV[i]
  end
end
if #ids == 0 then return {} end
return redis.call('XCLAIM', KEYS[2], ARGV[1], ARGV[2], ARGV[3], unpack(ids))
"""


def claim(s: Scripts, stream: str, consumer: str, min_idle: int, owner: str, ids: list[str]) -> list[Any]:
    batch_id, prio = keys.parse_jobs_key(stream)
    return list(s.run(CLAIM, [keys.meta(batch_id), stream, keys.handoff(batch_id, prio)],
                      [keys.GROUP, consumer, min_idle, owner, *ids]))


# Fencing: true when entry ARGV[1] is pending under consumer ARGV[3] of group ARGV[2] in stream KEYS[1].
# A worker whose heartbeat lapsed may have lost its jobs to another; it must not touch them then.
_OWNED = """
local function owned(stream, group, id, consumer)
  return #redis.call('XPENDING', stream, group, id, id, 1, consumer) == 1
end
"""

# Puts a delivered job back at the end of its stream for any worker (a draining or sick worker's
# leftovers), carrying the attempts it already had; only if we still hold it.
# KEYS: stream; ARGV: entry id, group, job JSON, attempts, consumer -> 1 if put back
REQUEUE = _OWNED + """
if not owned(KEYS[1], ARGV[2], ARGV[1], ARGV[5]) then return 0 end
redis.call('XACK', KEYS[1], ARGV[2], ARGV[1])
redis.call('XADD', KEYS[1], '*', 'j', ARGV[3], 'a', ARGV[4])
redis.call('XDEL', KEYS[1], ARGV[1])
return 1
"""


def requeue(s: Scripts, stream: str, entry_id: str, job_json: str, attempts: int, consumer: str,
            client: Any = None) -> Any:
    return s.run(REQUEUE, [stream], [entry_id, keys.GROUP, job_json, attempts, consumer], client)

# Counts one more delivery of a job its worker still holds (XCLAIM to itself bumps the counter).
# KEYS: stream; ARGV: entry id, group, consumer -> 1 if counted, 0 if another worker has it
BUMP = _OWNED + """
if not owned(KEYS[1], ARGV[2], ARGV[1], ARGV[3]) then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[2], ARGV[3], 0, ARGV[1])
return 1
"""


def bump(s: Scripts, stream: str, entry_id: str, consumer: str) -> bool:
    return bool(s.run(BUMP, [stream], [entry_id, keys.GROUP, consumer]))

# KEYS: meta, events; ARGV: now -> final batch status reached or ''
FINISH = _FINISH + "return finish_if_done(KEYS[1], KEYS[2], ARGV[1])"


def finish(s: Scripts, batch_id: str, now: float) -> str:
    return s.run(FINISH, [keys.meta(batch_id), keys.events(batch_id)], [now]) or ""

# Moves a batch from one of the listed states to a new one, stamping a time field (with its event if final).
# KEYS: meta, events; ARGV: new status, time field, now, allowed old status... -> the old status
TRANSITION = _EVENT + """
local old = redis.call('HGET', KEYS[1], 'status')
if not old then return false end
for i = 4, #ARGV do
  if old == ARGV[i] then
    redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
    if ARGV[1] == 'completed' or ARGV[1] == 'failed' or ARGV[1] == 'expired' or ARGV[1] == 'cancelled' then
      batch_event(KEYS[1], KEYS[2], ARGV[1], ARGV[3])
    end
    return old
  end
end
return old
"""


def transition(s: Scripts, batch_id: str, new: str, time_field: str, now: float, allowed: tuple[str, ...],
               client: Any = None) -> str | None:
    """Set status ``new`` if the batch is in one of ``allowed``; returns the old status (None: no batch)."""
    return s.run(TRANSITION, [keys.meta(batch_id), keys.events(batch_id)], [new, time_field, now, *allowed], client)


# Appends a chunk of jobs to one job stream with their custom_id <-> idx maps, atomically, so the
# maps and the stream never disagree; a job of a prefix group carries it (field g, read by PULL).
# KEYS: stream, custom_id -> idx hash, idx -> custom_id hash
# ARGV: (job JSON, custom_id, idx, prefix group or '') per job
ENQUEUE = """
for i = 1, #ARGV, 4 do
  if ARGV[i + 3] == '' then
    redis.call('XADD', KEYS[1], '*', 'j', ARGV[i])
  else
    redis.call('XADD', KEYS[1], '*', 'j', ARGV[i], 'g', ARGV[i + 3])
  end
  redis.call('HSET', KEYS[2], ARGV[i + 1], ARGV[i + 2])
  redis.call('HSET', KEYS[3], ARGV[i + 2], ARGV[i + 1])
end
return #ARGV / 4
"""

def enqueue(s: Scripts, batch_id: str, stream: str, jobs: list[str | int], client: Any = None) -> Any:
    """``jobs``: (job JSON, custom_id, idx, prefix group or '') per job, flat."""
    return s.run(ENQUEUE, [stream, keys.custom_ids(batch_id), keys.job_custom_ids(batch_id)], jobs, client)


# A chunk of results is in a file now (jobs/spill.py): note its last id and drop it from the stream.
# Only if no other process noted chunk ARGV[1] meanwhile, so two spillers never both advance.
# KEYS: meta, results, spill chunks list; ARGV: chunk number, its last id, the id after it -> 1 if noted
SPILLED = """
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('LLEN', KEYS[3]) ~= tonumber(ARGV[1]) then return 0 end
redis.call('RPUSH', KEYS[3], ARGV[2])
redis.call('HSET', KEYS[1], 'spilled', ARGV[2])
redis.call('XTRIM', KEYS[2], 'MINID', ARGV[3])
return 1
"""


def note_spilled(s: Scripts, batch_id: str, chunk: int, last_id: str, next_id: str) -> bool:
    ks = [keys.meta(batch_id), keys.results(batch_id), keys.spill_chunks(batch_id)]
    return bool(s.run(SPILLED, ks, [chunk, last_id, next_id]))

# Where a reader stands, atomically against SPILLED: the last spilled id and the results after the
# cursor still in the stream (meaningful only when the cursor is at or after the spilled id).
# KEYS: meta, results; ARGV: XRANGE start ('-' or '(id'), count -> {spilled id or '', entries}
READ_RESULTS = """
local spilled = redis.call('HGET', KEYS[1], 'spilled') or ''
return {spilled, redis.call('XRANGE', KEYS[2], ARGV[1], '+', 'COUNT', ARGV[2])}
"""


def results_after(s: Scripts, batch_id: str, start: str, count: int) -> tuple[str, list[Any]]:
    spilled_id, entries = s.run(READ_RESULTS, [keys.meta(batch_id), keys.results(batch_id)], [start, count])
    return spilled_id or "", entries

# A streaming job's new text (jobs/interactive.py), appended only while its request lives: the API deletes
# the request's keys once it is answered or given up, and an append after that must not bring its deltas
# stream back (nobody would read it; it would sit out its TTL).
# KEYS: meta, deltas; ARGV: ttl seconds, worker id, attempt, (sample index, text)... -> entries appended
APPEND_DELTAS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 4, #ARGV, 2 do
  redis.call('XADD', KEYS[2], '*', 'w', ARGV[2], 'a', ARGV[3], 'n', ARGV[i], 't', ARGV[i + 1])
end
redis.call('EXPIRE', KEYS[2], ARGV[1])
return (#ARGV - 3) / 2
"""


def append_deltas(s: Scripts, batch_id: str, worker: str, attempt: int, texts: list[tuple[int, str]], ttl: int,
                  client: Any = None) -> Any:
    """``texts``: (sample index, text) each; on ``client`` (a pipeline) or at once."""
    args: list[Any] = [ttl, worker, attempt]
    for index, text in texts:
        args += [index, text]
    return s.run(APPEND_DELTAS, [keys.meta(batch_id), keys.deltas(batch_id)], args, client)


# Gives jobs that ended failed or expired a new delivery (`sluice requeue`, `sluice retry`): each job whose
# outcome is still the one the caller read (done[idx] == its results id: a compare-and-set, so two reopens
# or a reopen racing a worker's write never double a job) loses that outcome (its counter, its results
# entry, its dead letter, its kept input, its error and sick tallies, its deadline) and is queued again
# with no deliveries; a final batch is in progress again, with its completion window anew from now.
# KEYS: meta, done, results, dead, inputs, last_errors, sick, deadlines, jobs stream
# ARGV: now, group, (idx, results id, its status, job JSON, old job entry id or '', dead entry id or '')...
# -> {jobs queued again, -1 if the batch may not reopen; the batch status found}
REOPEN = """
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'in_progress' and st ~= 'completed' and st ~= 'expired' then return {-1, st or ''} end
local n = 0
for i = 3, #ARGV, 6 do
  local idx = ARGV[i]
  if redis.call('HGET', KEYS[2], idx) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[2], idx)
    redis.call('HINCRBY', KEYS[1], ARGV[i + 2], -1)
    redis.call('XDEL', KEYS[3], ARGV[i + 1])
    if ARGV[i + 4] ~= '' then
      redis.call('XACK', KEYS[9], ARGV[2], ARGV[i + 4])
      redis.call('XDEL', KEYS[9], ARGV[i + 4])
    end
    if ARGV[i + 5] ~= '' then redis.call('XDEL', KEYS[4], ARGV[i + 5]) end
    redis.call('HDEL', KEYS[5], idx)
    redis.call('HDEL', KEYS[6], idx)
    redis.call('HDEL', KEYS[7], idx)
    redis.call('ZREM', KEYS[8], idx)
    redis.call('XADD', KEYS[9], '*', 'j', ARGV[i + 3])
    n = n + 1
  end
end
if n > 0 and st ~= 'in_progress' then
  -- Its completion window anew, from now (the window as first given, kept from the first reopen on).
  local m = redis.call('HMGET', KEYS[1], 'created_at', 'expires_at', 'window_s')
  local window = tonumber(m[3]) or ((tonumber(m[2]) or 0) - (tonumber(m[1]) or 0))
  redis.call('HSET', KEYS[1], 'window_s', tostring(window), 'expires_at', tostring(tonumber(ARGV[1]) + window))
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'reopened_at', ARGV[1])
  redis.call('HDEL', KEYS[1], 'completed_at', 'finalizing_at', 'expired_at')
end
return {n, st}
"""


def reopen(s: Scripts, batch_id: str, stream: str, jobs: list[tuple[int, str, str, str, str, str]],
           now: float) -> tuple[int, str]:
    """``jobs``: (idx, results id, status, job JSON, old entry id or '', dead entry id or '') each, all of
    ``stream``; (jobs queued again or -1 if the batch may not reopen, the batch status found)."""
    ks = [keys.meta(batch_id), keys.done(batch_id), keys.results(batch_id), keys.dead(batch_id),
          keys.inputs(batch_id), keys.last_errors(batch_id), keys.sick_episodes(batch_id), keys.deadlines(batch_id),
          stream]
    n, status = s.run(REOPEN, ks, [now, keys.GROUP, *(x for job in jobs for x in job)])
    return int(n), status or ""


# Takes up to ARGV[3] batches whose webhook delivery is due, leasing each (its score moved to ARGV[2]) so
# that of several API processes one delivers it. KEYS: webhooks_due; ARGV: now, lease end, count -> batch ids
TAKE_DUE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[3])
for _, bid in ipairs(due) do
  redis.call('ZADD', KEYS[1], 'XX', ARGV[2], bid)
end
return due
"""


def take_due(s: Scripts, now: float, lease_until: float, count: int) -> list[str]:
    return list(s.run(TAKE_DUE, [keys.webhooks_due()], [now, lease_until, count]))
