"""What every route needs: the settings, the file store, a Redis client (made on first use), the caller's key."""

from __future__ import annotations

import threading
from typing import Annotated

import redis
from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sluice.api.errors import ApiError
from sluice.api.filestore import FileStore
from sluice.api.gate import UNAUTHORIZED, key_ok
from sluice.api.settings import Settings
from sluice.jobs.connection import connect, external_url, recorded_url, redis_url


class AppState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.files = FileStore(settings.files_dir)
        self._redis: redis.Redis | None = None
        self._url: str | None = None
        self._lock = threading.Lock()

    def redis(self) -> redis.Redis:
        # Lazily: connecting may start the embedded server, which should not happen on import or in tests
        # that never touch the job plane.
        with self._lock:
            if self._redis is not None and self._moved():
                self._redis.close()
                self._redis = None
            if self._redis is None:
                self._url = self.settings.redis_url or redis_url()
                self._redis = connect(self._url)
            return self._redis

    def _moved(self) -> bool:
        """The embedded server was restarted on another port (by a worker, or ``sluice server``): follow
        it, as the workers do, so the API never stays on a server nobody writes to."""
        if self.settings.redis_url or external_url():
            return False
        recorded = recorded_url()
        return recorded is not None and recorded != self._url

    @property
    def connected(self) -> bool:
        """Whether a request has reached the job server yet (background tasks wait for that)."""
        return self._redis is not None

    def close(self) -> None:
        with self._lock:
            if self._redis is not None:
                self._redis.close()
                self._redis = None


def get_state(request: Request) -> AppState:
    return request.app.state.sluice


def get_redis(request: Request) -> redis.Redis:
    return get_state(request).redis()


State = Annotated[AppState, Depends(get_state)]
Redis = Annotated[redis.Redis, Depends(get_redis)]

_bearer = HTTPBearer(auto_error=False, description="SLUICE_API_KEY, when the server sets one")


def require_key(request: Request, creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """401 unless the request carries SLUICE_API_KEY (gate.key_ok; no check when the server sets no key).
    ``creds`` is there for the OpenAPI schema's security scheme."""
    h = request.headers
    if not key_ok(h.get("authorization"), get_state(request).settings.api_key, h.get("x-api-key")):
        raise ApiError(401, UNAUTHORIZED, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
