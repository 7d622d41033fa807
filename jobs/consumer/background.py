"""A session's side thread (heartbeat, cancel feed, upkeep): a daemon running ``_run`` until ``stop``."""

from __future__ import annotations

import threading


class Background:
    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop too: a loop waiting on it ends at once
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop after the pass under way; one stuck (a dead disk, a hung server) is left behind, a daemon."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        raise NotImplementedError
