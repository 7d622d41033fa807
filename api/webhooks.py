"""Delivering batch events to webhooks: the API process's background task works through the batches whose
events are due (jobs/webhooks.py), POSTs each event in OpenAI's shape, signed as Standard Webhooks says
(``webhook-id``, ``webhook-timestamp``, ``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">``),
and records every attempt; a failed one is retried with a doubling delay. Never on a request's path.

A batch names its own URL in metadata ``sluice_webhook_url``; the operator must allow it
(SLUICE_WEBHOOK_ALLOWED_URLS prefixes), checked when the batch is created and again before each delivery,
so a client cannot make the server POST to a host of its choosing. Redirects are not followed.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from sluice.api.errors import ApiError
from sluice.api.settings import Settings
from sluice.api.state import AppState
from sluice.jobs import webhooks
from sluice.jobs.webhooks import (
    DELIVERED,
    FAILED,
    NO_URL,
    PENDING,
    REFUSED,
    SETTLED,
    WEBHOOK_METADATA_KEY,
    Event,
)
from starlette.concurrency import run_in_threadpool

log = logging.getLogger(__name__)

POLL_EVERY = 1.0  # seconds between looks at the due set
LEASE = 120.0  # seconds a batch's deliveries are this process's (a POST times out well within)
POST_TIMEOUT = 10.0
BATCHES_PER_ROUND = 50
MAX_RETRY_AFTER = 3600.0


# ---- which URLs --------------------------------------------------------------------------------------
def allowed(url: str, s: Settings) -> bool:
    """The server's own URL, or an http(s) URL under one of SLUICE_WEBHOOK_ALLOWED_URLS (same scheme, host
    and port; the path starts with the prefix's; no credentials, no dot segments)."""
    if url == s.webhook_url:
        return True
    u = urlsplit(url)
    segments = unquote(u.path).split("/")
    if u.scheme not in ("http", "https") or not u.hostname or u.username or u.password or "." in segments \
            or ".." in segments:
        return False
    for prefix in filter(None, (p.strip() for p in s.webhook_allowed_urls.split(","))):
        q = urlsplit(prefix)
        if (u.scheme, u.netloc.lower()) == (q.scheme, q.netloc.lower()) and u.path.startswith(q.path):
            return True
    return False


def check_batch_webhook(metadata: dict[str, str] | None, s: Settings) -> None:
    """At creation: a batch's own webhook URL must be one the operator allows."""
    url = (metadata or {}).get(WEBHOOK_METADATA_KEY)
    if url is not None and not allowed(url, s):
        allow = s.webhook_allowed_urls or "none"
        raise ApiError(400, f"metadata {WEBHOOK_METADATA_KEY} {url!r} is not an allowed webhook URL (this server "
                       f"allows URLs under: {allow}; its operator sets SLUICE_WEBHOOK_ALLOWED_URLS)",
                       code="webhook_url_not_allowed", param=f"metadata.{WEBHOOK_METADATA_KEY}")


# ---- one POST ----------------------------------------------------------------------------------------
def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """Standard Webhooks' signature header value; a ``whsec_`` secret is base64 of the key."""
    key = base64.b64decode(secret.removeprefix("whsec_")) if secret.startswith("whsec_") else secret.encode()
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *a: Any, **kw: Any) -> None:
        return None  # a 3xx is a failed delivery: a redirect could lead anywhere


_opener = urllib.request.build_opener(_NoRedirects)


def post(url: str, ev: Event, secret: str | None) -> str | None:
    """Send one event; None if the receiver answered 2xx, else why not."""
    body = json.dumps(ev.payload(), separators=(",", ":")).encode()
    ts = int(time.time())
    headers = {"Content-Type": "application/json", "User-Agent": "sluice-webhooks", "webhook-id": ev.id,
               "webhook-timestamp": str(ts)}
    if secret:
        headers["webhook-signature"] = sign(secret, ev.id, ts, body)
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with _opener.open(req, timeout=POST_TIMEOUT) as resp:
            return None if 200 <= resp.status < 300 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return f"{type(e).__name__}: {getattr(e, 'reason', e)}"[:500]


# ---- the deliverer -----------------------------------------------------------------------------------
def deliver_due(r: redis.Redis, s: Settings, now: float | None = None) -> int:
    """One round: the due batches' pending events, each tried once; how many were delivered."""
    now = now if now is not None else time.time()
    return sum(deliver_batch(r, bid, s, now) for bid in webhooks.take(r, now, LEASE, BATCHES_PER_ROUND))


def deliver_batch(r: redis.Redis, batch_id: str, s: Settings, now: float) -> int:
    exists, named = webhooks.webhook_url(r, batch_id)
    if not exists:  # deleted since
        webhooks.settled(r, batch_id)
        return 0
    delivered, waiting = 0, []
    for ev in webhooks.batch_events(r, batch_id):
        d = ev.delivery
        if d.state in SETTLED:
            continue
        if d.next_attempt_at is None or d.next_attempt_at <= now:
            _attempt(ev, named, s)
            webhooks.record(r, ev)
            delivered += d.state == DELIVERED
        if d.state == PENDING:
            waiting.append(d.next_attempt_at or now)
    if waiting:
        webhooks.retry_at(r, batch_id, min(waiting))
    else:
        webhooks.settled(r, batch_id)
    return delivered


def _attempt(ev: Event, named: str | None, s: Settings) -> None:
    d = ev.delivery
    d.url = named or s.webhook_url
    if d.url is None:
        d.state = NO_URL
        return
    if named is not None and not allowed(named, s):
        d.state, d.last_error = REFUSED, "the batch's webhook URL is not in SLUICE_WEBHOOK_ALLOWED_URLS"
        return
    now = time.time()
    d.attempts += 1
    d.last_attempt_at = now
    d.last_error = post(d.url, ev, s.webhook_secret)
    if d.last_error is None:
        d.state, d.delivered_at, d.next_attempt_at = DELIVERED, now, None
    elif d.attempts >= s.webhook_max_attempts:
        d.state, d.next_attempt_at = FAILED, None
        log.error("webhook %s for batch %s: giving up after %d attempts: %s", ev.type, ev.batch_id, d.attempts,
                  d.last_error)
    else:
        d.next_attempt_at = now + min(s.webhook_retry_after * 2 ** (d.attempts - 1), MAX_RETRY_AFTER)


async def deliver_forever(state: AppState) -> None:
    """The API's background task: a round every POLL_EVERY seconds once the app has reached the job server
    (connecting here could start an embedded one for an app that never uses it)."""
    while True:
        if state.connected:
            try:
                await run_in_threadpool(deliver_due, state.redis(), state.settings)
            except (redis.RedisError, OSError, RuntimeError) as e:
                log.warning("webhook delivery round failed (retried): %s", e)
        await asyncio.sleep(POLL_EVERY)
