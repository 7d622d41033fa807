"""The worker's Redis connection: fails fast, reconnects with backoff, and follows an embedded server
that came back on another port. While it is down the worker keeps generating and holds results."""

from __future__ import annotations

import logging
import time

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from sluice.jobs.connection import connect, ensure_server, external_url, find_server
from sluice.jobs.scripts import Scripts

log = logging.getLogger(__name__)

BACKOFF_START = 0.1
BACKOFF_MAX = 5.0
START_EMBEDDED_AFTER = 10.0  # seconds down before this worker starts the embedded server itself


class Link:
    def __init__(self, url: str | None = None) -> None:
        self.fixed_url = url or external_url()
        self.url = self.fixed_url or ensure_server().url
        self.r, self.scripts = self._client(self.url)
        self.up = True
        self.backoff = BACKOFF_START
        self.retry_at = 0.0
        self.down_since = 0.0

    @staticmethod
    def _client(url: str) -> tuple[redis.Redis, Scripts]:
        # No retries inside redis-py: the worker loop must not stall; it retries on its own clock.
        r = connect(url, retry=Retry(NoBackoff(), 0), socket_timeout=5.0, socket_connect_timeout=1.0)
        return r, Scripts(r)

    def usable(self) -> bool:
        """Whether to try Redis now: it is up, or the next retry is due."""
        if self.up:
            return True
        if time.monotonic() < self.retry_at:
            return False
        self._follow_embedded()
        return True

    def failed(self, e: BaseException) -> None:
        now = time.monotonic()
        if self.up:
            log.warning("Redis unreachable (%s): generating on, holding results, reconnecting", e)
            self.down_since = now
        self.up = False
        self.retry_at = now + self.backoff
        self.backoff = min(self.backoff * 2, BACKOFF_MAX)

    def succeeded(self) -> bool:
        """Note a good round trip; True when it ends an outage."""
        if self.up:
            return False
        log.info("Redis reachable again after %.1fs", time.monotonic() - self.down_since)
        self.up = True
        self.backoff = BACKOFF_START
        return True

    def _follow_embedded(self) -> None:
        if self.fixed_url:
            return
        try:
            server = find_server()
            if server is None and time.monotonic() - self.down_since > START_EMBEDDED_AFTER:
                server = ensure_server()
        except (OSError, RuntimeError) as e:
            log.warning("embedded server: %s", e)
            return
        if server is not None and server.url != self.url:
            self.r.close()
            self.url = server.url
            self.r, self.scripts = self._client(self.url)
