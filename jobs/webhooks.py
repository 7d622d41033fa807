"""A batch's events (batch.completed, batch.failed, batch.expired, batch.cancelled) and the record of their
webhook deliveries, in Redis. The event is written by the script of the batch's final transition
(jobs/scripts.py: ``batch_event``), so none is lost or doubled; ``store.retire_batch`` then puts the batch
in the ``webhooks_due`` set, which the API's deliverer (api/webhooks.py) works through: at least once, with
retries, each attempt recorded here (``sluice events``, ``GET /v1/events``)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
from sluice.jobs import keys
from sluice.jobs.scripts import Scripts, take_due

WEBHOOK_METADATA_KEY = "sluice_webhook_url"  # the batch's own webhook URL, in its metadata
PENDING, DELIVERED, FAILED, NO_URL, REFUSED = "pending", "delivered", "failed", "no_url", "refused"
SETTLED = (DELIVERED, FAILED, NO_URL, REFUSED)  # no further attempt
SCAN_PAGE, RECENT_SCAN = 100, 10_000  # finished batches read per round trip, and at most, for recent_events


@dataclass
class Delivery:
    state: str = PENDING
    attempts: int = 0
    url: str | None = None
    last_error: str | None = None
    last_attempt_at: float | None = None
    delivered_at: float | None = None
    next_attempt_at: float | None = None


@dataclass
class Event:
    batch_id: str
    entry_id: str  # in the batch's events stream
    type: str
    created_at: float
    delivery: Delivery = field(default_factory=Delivery)

    @property
    def id(self) -> str:
        """Stable across retries (Standard Webhooks' ``webhook-id``: receivers deduplicate by it)."""
        return "evt_" + hashlib.sha256(f"{self.batch_id}/{self.entry_id}".encode()).hexdigest()[:24]

    def payload(self) -> dict[str, Any]:
        """OpenAI's webhook event shape."""
        return {"object": "event", "id": self.id, "type": self.type, "created_at": int(self.created_at),
                "data": {"id": self.batch_id}}

    def to_dict(self) -> dict[str, Any]:
        return {**self.payload(), "delivery": asdict(self.delivery)}


def batch_events(r: redis.Redis, batch_id: str) -> list[Event]:
    """A batch's events, oldest first, each with its delivery so far."""
    pipe = r.pipeline(transaction=False)
    pipe.xrange(keys.events(batch_id))
    pipe.hgetall(keys.webhook_deliveries(batch_id))
    entries, deliveries = pipe.execute()
    return [Event(batch_id, eid, f["t"], float(f["at"]),
                  Delivery(**json.loads(deliveries[eid])) if eid in deliveries else Delivery())
            for eid, f in entries]


def recent_events(r: redis.Redis, limit: int = 20) -> list[Event]:
    """Up to ``limit`` events of the most recently finished batches, newest first (online requests, which
    have none, are passed over: at most RECENT_SCAN finished batches are looked at)."""
    out: list[Event] = []
    for start in range(0, RECENT_SCAN, SCAN_PAGE):
        page = r.zrevrange(keys.finished_batches(), start, start + SCAN_PAGE - 1)
        for bid in page:
            out += reversed(batch_events(r, bid))
            if len(out) >= limit:
                return out[:limit]
        if len(page) < SCAN_PAGE:
            break
    return out


def webhook_url(r: redis.Redis, batch_id: str) -> tuple[bool, str | None]:
    """(the batch exists, the URL it named in its metadata or None)."""
    raw = r.hget(keys.meta(batch_id), "metadata")
    if raw is None:
        return False, None
    return True, json.loads(raw or "{}").get(WEBHOOK_METADATA_KEY) or None


def take(r: redis.Redis, now: float, lease: float, count: int) -> list[str]:
    """Batches whose deliveries are due, leased to this process for ``lease`` seconds."""
    return take_due(Scripts(r), now, now + lease, count)


def record(r: redis.Redis, ev: Event) -> None:
    r.hset(keys.webhook_deliveries(ev.batch_id), ev.entry_id, json.dumps(asdict(ev.delivery)))


def retry_at(r: redis.Redis, batch_id: str, when: float) -> None:
    r.zadd(keys.webhooks_due(), {batch_id: when}, xx=True)


def settled(r: redis.Redis, batch_id: str) -> None:
    """Every event of the batch is settled: out of the due set, unless one came meanwhile (its retire's
    ZADD NX may have run before our ZREM; checked after it, so one of the two sees it)."""
    r.zrem(keys.webhooks_due(), batch_id)
    if any(ev.delivery.state == PENDING for ev in batch_events(r, batch_id)):
        r.zadd(keys.webhooks_due(), {batch_id: 0})
