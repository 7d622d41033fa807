"""The queue's cancel events, read by their own thread with a blocking XREAD; the step loop takes
what arrived before its next step, so a cancelled job's sequences stop within a step."""

from __future__ import annotations

import time
from collections import deque

from redis.backoff import NoBackoff
from redis.retry import Retry
from sluice.jobs.connection import connect
from sluice.jobs.consumer import commands as consumer
from sluice.jobs.consumer.background import Background
from sluice.jobs.consumer.commands import CancelEvent
from sluice.jobs.consumer.link import Link

BLOCK_MS = 250  # one blocking read; also how long it takes to notice a stop


class CancelFeed(Background):
    def __init__(self, link: Link, queue: str, redis_down: tuple[type[BaseException], ...]) -> None:
        super().__init__("sluice-cancels")
        self.link = link
        self.queue = queue
        self.redis_down = redis_down
        self.cursor = consumer.cancel_cursor(link.r, queue)  # only events from now on
        self.events: deque[CancelEvent] = deque()

    def take(self) -> list[CancelEvent]:
        out = []
        while self.events:
            out.append(self.events.popleft())
        return out

    def _run(self) -> None:
        client, url = None, None
        while not self._stop.is_set():
            try:
                if client is None or url != self.link.url:  # the link follows a server that moved
                    url = self.link.url
                    client = connect(url, retry=Retry(NoBackoff(), 0), socket_timeout=5.0, socket_connect_timeout=1.0)
                self.cursor, got = consumer.read_cancels(client, self.queue, self.cursor, BLOCK_MS)
            except self.redis_down:
                if client is not None:  # a fresh client next time: a cluster's may have lost its map of nodes
                    client.close()
                client = None
                time.sleep(0.2)
                continue
            self.events.extend(got)
        if client is not None:
            client.close()
