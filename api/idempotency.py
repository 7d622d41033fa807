"""The ``Idempotency-Key`` header of ``POST /v1/batches`` and ``POST /v1/files``: a retried request with the
same key and the same body gets the object the first one made (a fresh read of it, with the header
``Idempotent-Replayed: true``), not a second one; the same key with another body is a 409. Keys are kept
IDEMPOTENCY_TTL after the first request, per endpoint.

The first request claims the key (SET NX, a short lease while it works), then records the object's id;
a duplicate arriving meanwhile waits for that id. A request that fails gives the key up, so a retry runs.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Annotated, Any

import redis
from fastapi import Header, Response
from sluice.api.errors import ApiError
from sluice.jobs import keys

IDEMPOTENCY_TTL = 24 * 3600  # seconds a key is remembered (as Stripe's)
WORKING_LEASE = 600  # seconds a key stays claimed by a request that never finished (its process died)
DUPLICATE_WAIT = 60.0  # seconds a duplicate waits for the first request's object before a 409
MAX_KEY_CHARS = 255

IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key", description=(
    "Makes the request safe to retry: the same key with the same body returns the object the first request "
    f"made (kept {IDEMPOTENCY_TTL // 3600} h); the same key with another body is a 409."))]


def fingerprint(*parts: Any) -> str:
    """What makes two requests "the same body": a hash of their canonical JSON."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def once(r: redis.Redis, scope: str, key: str | None, body: Callable[[], str], create: Callable[[], dict[str, Any]],
         fetch: Callable[[str], dict[str, Any] | None], response: Response,
         abandon: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """``create()`` once per ``key`` (no key: every time). ``body()`` is the request's fingerprint,
    ``fetch(id)`` the object of that id now (None: gone, the first answer is returned as it was);
    ``abandon()`` drops what this request prepared when it turns out to be a replay."""
    if key is None:
        return create()
    _check(key)
    k, fp, token = keys.idempotency(scope, key), body(), secrets.token_hex(8)
    deadline = time.monotonic() + DUPLICATE_WAIT
    while True:
        if r.set(k, json.dumps({"fp": fp, "working": token}), nx=True, ex=WORKING_LEASE):
            return _first(r, k, fp, token, create)
        seen = json.loads(r.get(k) or "null")
        if seen is None:
            continue  # the first request failed and gave the key up: claim it
        if seen["fp"] != fp:
            raise ApiError(409, f"Idempotency-Key {key!r} was already used with a different request body; use a new "
                           "key for a new request", code="idempotency_key_reused")
        if "id" in seen:
            abandon()
            response.headers["Idempotent-Replayed"] = "true"
            return fetch(seen["id"]) or seen["object"]
        if time.monotonic() > deadline:
            raise ApiError(409, f"a request with Idempotency-Key {key!r} is still being processed; retry later",
                           code="idempotency_key_in_use")
        time.sleep(0.05)


def _first(r: redis.Redis, k: str, fp: str, token: str, create: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        obj = create()
    except BaseException:
        if json.loads(r.get(k) or "null") == {"fp": fp, "working": token}:
            r.delete(k)  # a retry may run (a lease lost meanwhile is someone else's now)
        raise
    r.set(k, json.dumps({"fp": fp, "id": obj["id"], "object": obj}), ex=IDEMPOTENCY_TTL)
    return obj


def _check(key: str) -> None:
    if not key or len(key) > MAX_KEY_CHARS or not key.isascii() or not key.isprintable():
        raise ApiError(400, f"Idempotency-Key must be 1 to {MAX_KEY_CHARS} printable ASCII characters",
                       code="invalid_idempotency_key", param="Idempotency-Key")
