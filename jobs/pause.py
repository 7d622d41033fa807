"""Pausing a batch: no new job of it is handed to a worker until it is resumed.

The pause is the batch's meta field ``paused_at``; workers' reads and claims check it in the same
script that hands out the job (``scripts.pull``, ``scripts.claim``), so once ``pause_batch`` returns,
no worker gets another job of the batch. Jobs already running finish; with ``now``, the workers holding
them abort them and put them back in the queue, not counted as a delivery (the cancel feed carries a
``paused`` event). The completion window keeps running while a batch is paused.
"""

from __future__ import annotations

import time

import redis
from sluice.jobs import keys
from sluice.jobs.consumer.commands import publish_cancel, restore_ready
from sluice.jobs.schemas import Batch
from sluice.jobs.scripts import Scripts
from sluice.jobs.store import get_batch, priorities

PAUSABLE = ("validating", "in_progress")  # a final or cancelling batch has nothing left to hold back

# KEYS: meta; ARGV: now, pausable status... -> the status ('' if no batch); pauses only a pausable one
PAUSE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
for i = 2, #ARGV do
  if status == ARGV[i] then
    redis.call('HSETNX', KEYS[1], 'paused_at', ARGV[1])
    return status
  end
end
return status
"""


class NotPausable(ValueError):
    """The batch is final or being cancelled."""


def pause_batch(r: redis.Redis, batch_id: str, now: bool = False) -> Batch | None:
    """Pause a batch (None if there is no such batch); ``now``: also hand its running jobs back to the
    queue uncharged. Pausing a paused batch changes nothing (``now`` still hands back what runs)."""
    status = Scripts(r).run(PAUSE, [keys.meta(batch_id)], [time.time(), *PAUSABLE])
    if not status:
        return None
    if status not in PAUSABLE:
        raise NotPausable(f"batch {batch_id} is {status}: only a validating or in-progress batch can be paused")
    queue, streams = _streams(r, batch_id)
    if streams:  # readers skip it from now on (it would hand out nothing anyway)
        r.zrem(keys.ready_streams(queue), *streams)
    if now:
        publish_cancel(r, queue, batch_id, None, "paused")
    return get_batch(r, batch_id)


def resume_batch(r: redis.Redis, batch_id: str) -> Batch | None:
    """Hand out the batch's jobs again (None if there is no such batch); resuming a batch that is not
    paused changes nothing."""
    if not r.exists(keys.meta(batch_id)):
        return None
    r.hdel(keys.meta(batch_id), "paused_at")
    # After the flag is gone: a reader that saw the pause puts the stream back itself if it ran after us.
    model, created = r.hmget(keys.meta(batch_id), "model", "created_at")
    restore_ready(r, keys.queue_name(model), batch_id, priorities(r, batch_id), float(created or 0))
    return get_batch(r, batch_id)


def _streams(r: redis.Redis, batch_id: str) -> tuple[str, list[str]]:
    queue = keys.queue_name(r.hget(keys.meta(batch_id), "model"))
    return queue, [keys.jobs(batch_id, p) for p in priorities(r, batch_id)]
