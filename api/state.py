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
from sluice.jobs.connection import connect


class AppState:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.files = FileStore(settings.files_dir)
        self._redis: redis.Redis | None = None
        self._lock = threading.Lock()

    def redis(self) -> redis.Redis:
        # Lazily: connecting may start the embedded server, which should not happen on import or in tests
        # that never touch the job plane.
        with self._lock:
            if self._redis is None:
                self._redis = connect(self.settings.redis_url)
            return self._redis

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
