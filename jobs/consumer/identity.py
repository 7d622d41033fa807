"""A worker's id: one no live worker holds, held by its heartbeat key. Our own id, left by a dead
process of this host, is taken over at once, so a restarted worker picks up its own pending jobs."""

from __future__ import annotations

import itertools
import socket
import time
from collections.abc import Callable

import redis
from sluice.jobs.connection import pid_alive
from sluice.jobs.consumer import commands as consumer

SERVER_RESTART_WAIT_S = 60.0  # a server restarting as the worker starts is waited for, not crashed on


def take_identity(r: redis.Redis, base: str, explicit: bool, payload: Callable[[str], str], ttl: float) -> str:
    """``base``, else ``base-2``, ``base-3``...; an ``explicit`` id waits out a TTL for its holder, then fails.
    A server unreachable for a moment (restarting) is retried for up to SERVER_RESTART_WAIT_S."""
    deadline = time.monotonic() + SERVER_RESTART_WAIT_S
    while True:
        try:
            return _take(r, base, explicit, payload, ttl)
        except redis.ConnectionError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def _take(r: redis.Redis, base: str, explicit: bool, payload: Callable[[str], str], ttl: float) -> str:
    for n in itertools.count(1):
        wid = base if n == 1 else f"{base}-{n}"
        if _try(r, wid, payload, ttl, wait=explicit):
            return wid
        if explicit:
            raise ValueError(f"worker id {wid!r} is held by a live worker; pick another --worker-id")
    raise AssertionError("unreachable")


def _try(r: redis.Redis, wid: str, payload: Callable[[str], str], ttl: float, wait: bool) -> bool:
    ttl_ms = int(ttl * 1000)
    deadline = time.monotonic() + (ttl + 1 if wait else 0)
    while True:
        if consumer.claim_identity(r, wid, payload(wid), ttl_ms):
            return True
        holder = consumer.identity_holder(r, wid)
        if holder is not None and holder.host == socket.gethostname() and not pid_alive(holder.pid):
            consumer.take_over(r, wid, payload(wid), ttl_ms)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
