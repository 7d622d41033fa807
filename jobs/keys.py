"""Every Redis key name the job plane uses; nothing else spells them.

Sharding: everything about one batch carries the hash tag ``{<batch_id>}`` (its job streams, their
consumer group, meta and counters, results, dead letters, spilled-results index), so the one atomic write per completion
(result + counters + results stream + XACK) touches a single Redis Cluster slot, and batches spread
over the cluster. The few keys outside a batch (the batch index, each model's list of active job
streams, cancel events, worker heartbeats, batches whose Celery completion signature is due) are
small and are never part of an atomic write: on a Redis Cluster each lives in its own slot, and the
commands that read several (heartbeats, the streams of a queue) are pipelined, routed key by key.
"""

from __future__ import annotations

import uuid

PREFIX = "sluice"
GROUP = "workers"  # the consumer group on every job stream


def new_batch_id() -> str:
    return f"batch_{uuid.uuid4().hex[:24]}"


DEFAULT_QUEUE = "default"  # the queue of jobs that name no model


def queue_name(model: str | None) -> str:
    """The name a model's jobs are queued under: the model string as given, None (or "") -> "default";
    a LoRA adapter's ``"base:adapter"`` -> the base's queue (``split_model``). The one place that rule is
    spelled: a stored model (already a queue name) comes back unchanged."""
    name = split_model(model)[0] if model else DEFAULT_QUEUE
    # Braces would be read as a hash tag by Redis Cluster.
    return name.replace("{", "(").replace("}", ")")


def split_model(model: str) -> tuple[str, str | None]:
    """``"base:adapter"`` -> (base, adapter): a LoRA adapter served by the workers of ``base``; anything
    else -> (model, None). The adapter is what follows the last colon, when that is a plain name (no
    path separator), so a Windows drive letter or a path with a colon stays the base model."""
    base, sep, adapter = model.rpartition(":")
    if not sep or not base or not adapter or any(c in adapter for c in "/\\") or len(base) == 1:
        return model, None
    return base, adapter


def parse_lora_module(spec: str) -> tuple[str, str]:
    """A worker's ``--lora NAME=PATH`` -> (name, path); a ValueError says what is wrong."""
    name, sep, path = spec.partition("=")
    name = name.strip()
    if not sep or not name or not path.strip():
        raise ValueError(f"--lora takes NAME=PATH, not {spec!r}")
    if any(c in name for c in ":/\\{} "):
        raise ValueError(f"LoRA adapter name {name!r} may not contain ':', '/', '\\', braces or spaces")
    return name, path.strip()


def check_batch_id(batch_id: str) -> str:
    if not batch_id or any(c in batch_id for c in "{}: \n"):
        raise ValueError(f"bad batch id {batch_id!r}")
    return batch_id


# ---- one batch: all under the hash tag {batch_id} -------------------------------------------------
def _b(batch_id: str, what: str) -> str:
    return f"{PREFIX}:{{{batch_id}}}:{what}"


def meta(batch_id: str) -> str:
    """Hash: status, model, timestamps, counters (total, completed, failed, cancelled, expired, invalid)."""
    return _b(batch_id, "meta")


def jobs(batch_id: str, priority: int) -> str:
    """Stream of the batch's jobs at one priority, with consumer group GROUP."""
    return _b(batch_id, f"jobs:{priority}")


def groups(batch_id: str) -> str:
    """Hash: prefix group -> the worker that took its first jobs (affinity, jobs/consumer/commands.py)."""
    return _b(batch_id, "groups")


def readers(batch_id: str) -> str:
    """Hash: worker -> when it last read the batch's jobs (a group's owner is live while this is recent)."""
    return _b(batch_id, "readers")


def handoff(batch_id: str, priority: int) -> str:
    """Sorted set of "<worker>\t<entry id>": jobs of ``jobs(batch_id, priority)`` handed to their group's
    owner (pending under it) and not yet taken by it."""
    return _b(batch_id, f"handoff:{priority}")


def done(batch_id: str) -> str:
    """Hash: job idx -> id of its entry in ``results``; a job's presence here means it has its outcome."""
    return _b(batch_id, "done")


def results(batch_id: str) -> str:
    """Stream of results in completion order (fields: i = job idx, r = Result JSON)."""
    return _b(batch_id, "results")


def dead(batch_id: str) -> str:
    """Dead-letter stream: jobs delivered too often (fields: i, job, error, deliveries)."""
    return _b(batch_id, "dead")


def inputs(batch_id: str) -> str:
    """Hash: job idx -> "<status> <Job JSON>" of each job a worker gave a failed or expired outcome (its stream
    entry is deleted then), so `sluice retry` can run it again; only failures cost memory here."""
    return _b(batch_id, "inputs")


def line_errors(batch_id: str) -> str:
    """List of rejected input lines (LineErrorInfo JSON)."""
    return _b(batch_id, "line_errors")


def custom_ids(batch_id: str) -> str:
    """Hash: custom_id -> job idx."""
    return _b(batch_id, "cids")


def job_custom_ids(batch_id: str) -> str:
    """Hash: job idx -> custom_id (for outcomes written without the job at hand: cancel, expiry)."""
    return _b(batch_id, "jcids")


def last_errors(batch_id: str) -> str:
    """Hash: job idx -> the last error a worker hit running it (for the dead letter)."""
    return _b(batch_id, "last_errors")


def sick_episodes(batch_id: str) -> str:
    """Hash: job idx -> times a worker's engine went sick (failed even a probe request) while it held the
    job; a job with any runs alone from then on (jobs/consumer/session.py)."""
    return _b(batch_id, "sick")


def deadlines(batch_id: str) -> str:
    """Sorted set: job idx scored by its deadline (only jobs that have one)."""
    return _b(batch_id, "deadlines")


def spill_chunks(batch_id: str) -> str:
    """List: the last results-stream id of each chunk of results moved to files (jobs/spill.py), in order;
    meta field ``spilled`` is the last of them (results up to it are in files, after it in ``results``)."""
    return _b(batch_id, "spill_chunks")


def spill_lock(batch_id: str) -> str:
    """String with a TTL: a process is moving results of the batch to files."""
    return _b(batch_id, "spill_lock")


def deltas(batch_id: str) -> str:
    """Stream of a streaming interactive request's text as it is generated (fields in jobs/interactive.py)."""
    return _b(batch_id, "deltas")


def events(batch_id: str) -> str:
    """Stream of the batch's events (fields: t = type such as batch.completed, at = time), each written by the
    script of its transition (jobs/scripts.py), for the webhook deliverer (jobs/webhooks.py)."""
    return _b(batch_id, "events")


def webhook_deliveries(batch_id: str) -> str:
    """Hash: events stream entry id -> its webhook delivery (JSON: state, attempts, last error, ...)."""
    return _b(batch_id, "webhook")


def batch_keys(batch_id: str, priorities: list[int]) -> list[str]:
    return [meta(batch_id), done(batch_id), results(batch_id), dead(batch_id), line_errors(batch_id),
            custom_ids(batch_id), job_custom_ids(batch_id), last_errors(batch_id), deadlines(batch_id),
            sick_episodes(batch_id), inputs(batch_id), spill_chunks(batch_id), spill_lock(batch_id), events(batch_id),
            webhook_deliveries(batch_id), groups(batch_id), readers(batch_id),
            *(jobs(batch_id, p) for p in priorities), *(handoff(batch_id, p) for p in priorities)]


def parse_jobs_key(key: str) -> tuple[str, int]:
    """``jobs(batch_id, priority)`` -> (batch_id, priority)."""
    return key[key.index("{") + 1: key.index("}")], int(key.rpartition(":")[2])


# ---- global: small, never inside an atomic write --------------------------------------------------
def all_batches() -> str:
    """Sorted set: every batch id by creation time."""
    return f"{PREFIX}:batches"


def open_batches() -> str:
    """Sorted set: batches not yet in a final state, by creation time (housekeeping walks these)."""
    return f"{PREFIX}:batches:open"


def finished_batches() -> str:
    """Sorted set: batches in a final state, by the time they got there (for the results TTL)."""
    return f"{PREFIX}:batches:finished"


def active_streams(queue: str) -> str:
    """Sorted set: every job stream of a model's open batches (where pending jobs of dead workers are
    looked for); lower score first."""
    return f"{PREFIX}:queue:{queue}:streams"


def queue_of_active_streams(key: str) -> str:
    """``active_streams(queue)`` -> queue."""
    return key.removeprefix(f"{PREFIX}:queue:").removesuffix(":streams")


def ready_streams(queue: str) -> str:
    """Sorted set: a model's job streams that may hold undelivered jobs; lower score is pulled first.
    A reader that finds one empty takes it out and reads it once more (jobs/consumer/commands.py); a writer
    adds it after every XADD. So an empty stream never hides one with work, however many there are."""
    return f"{PREFIX}:queue:{queue}:ready"


def interactive(queue: str) -> str:
    """Sorted set: the interactive requests (one-job batches) of a model waiting for their answer, scored by
    admission time; its size is the bound behind the API's 429 (jobs/interactive.py)."""
    return f"{PREFIX}:queue:{queue}:interactive"


def cancels(queue: str) -> str:
    """Stream of cancel events for a model's workers (fields in jobs/consumer/commands.py: publish_cancel)."""
    return f"{PREFIX}:queue:{queue}:cancels"


def heartbeat(worker_id: str) -> str:
    """String with a TTL: present while the worker lives."""
    return f"{PREFIX}:worker:{worker_id}"


def worker_pattern() -> str:
    return f"{PREFIX}:worker:*"


def completions() -> str:
    """List of batch ids whose completion signature is due; the Celery side sends them (jobs/celery_app.py)."""
    return f"{PREFIX}:celery:completions"


def webhooks_due() -> str:
    """Sorted set: finished batches whose events may wait for a webhook delivery, by when to try next."""
    return f"{PREFIX}:webhooks:due"


def housekeeping_lock() -> str:
    return f"{PREFIX}:lock:housekeeping"


def stream_score(priority: int, created_at: float) -> float:
    """Higher priority first, then older batches first."""
    return -priority * 1e10 + created_at


def idempotency(scope: str, key: str) -> str:
    """String with a TTL: what a request with this ``Idempotency-Key`` header made (api/idempotency.py)."""
    return f"{PREFIX}:idempotency:{scope}:{key}"
