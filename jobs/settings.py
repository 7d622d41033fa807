"""Settings read from ``SLUICE_*`` environment variables, typed and validated in one place (pydantic-settings).

``JobPlaneSettings`` is what every process that talks to the job server reads (the CLI, the worker,
the API); the API's own limits extend it in ``sluice.api.settings``. The engine's flags are not here: they are
``sluice`` options that click also reads from the environment (``SLUICE_MODEL``, ...; see ``--help``).
A bad value fails with one line naming the variable (``SettingsError``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import platformdirs
from pydantic import ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sluice.jobs.units import parse_size

ENV_PREFIX = "SLUICE_"
MIN_RESULT_BYTES = 16 << 10  # a failed result saying why its own was too large must fit
URL_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://", "unix://")
S = TypeVar("S", bound=BaseSettings)


class SettingsError(ValueError):
    """A SLUICE_* variable holds a value its setting cannot take."""


def _default_home() -> Path:
    return Path(platformdirs.user_data_dir("sluice", appauthor=False))


class JobPlaneSettings(BaseSettings):
    # Empty means unset, as a shell's `VAR=` or compose's `${VAR:-}` intend.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_ignore_empty=True, extra="ignore")

    home: Path = _default_home()
    """SLUICE_HOME: the embedded job server's data (and the API's files)."""
    redis_url: str | None = None
    """SLUICE_REDIS_URL: an external Redis/Valkey instead of the embedded server; ``redis+cluster://``
    (or ``rediss+cluster://``) names one node of a Redis/Valkey Cluster, whose other nodes are found."""
    files_dir: Path | None = None
    """SLUICE_FILES_DIR: the API's uploaded and rendered files, and spilled results [default: SLUICE_HOME/files]."""
    results_spill: int = 0
    """SLUICE_RESULTS_SPILL: move a batch's results from Redis to SLUICE_FILES_DIR once it holds more
    than this many there (0: never; every process that reads or writes results must see that directory)."""
    max_result_bytes: int = 64 << 20
    """SLUICE_MAX_RESULT_BYTES: the largest result (a size: bytes of its JSON) a worker writes for one job; a larger
    one fails that job alone (``result_too_large``). Well under the 512 MB a Valkey/Redis value can hold
    (proto-max-bulk-len), and what a reader of the batch then holds in memory."""

    @field_validator("home")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        return v.expanduser()

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(URL_SCHEMES):
            raise ValueError("must be a redis://, rediss://, redis+cluster://, rediss+cluster:// or unix:// URL")
        return v

    @field_validator("results_spill")
    @classmethod
    def _not_negative(cls, v: int) -> int:
        if v < 0:
            raise ValueError("must be 0 (never) or more")
        return v

    @field_validator("max_result_bytes", mode="before")
    @classmethod
    def _size(cls, v: Any) -> int:
        return parse_size(v)

    @field_validator("max_result_bytes")
    @classmethod
    def _room_for_an_error(cls, v: int) -> int:
        if v < MIN_RESULT_BYTES:
            raise ValueError(f"must be at least {MIN_RESULT_BYTES} bytes")
        return v

    @model_validator(mode="after")
    def _files_under_home(self) -> JobPlaneSettings:
        if self.files_dir is None:
            self.files_dir = self.home / "files"
        return self


def load(cls: type[S], **overrides: object) -> S:
    """``cls`` from the environment (``overrides`` win), a bad value raised as one SettingsError line."""
    try:
        return cls(**overrides)  # type: ignore[arg-type]  # overrides are field values, checked by pydantic
    except ValidationError as e:
        err = e.errors()[0]
        name = ENV_PREFIX + str(err["loc"][0]).upper() if err["loc"] else cls.__name__
        raise SettingsError(f"{name}: {err['msg']} (got {err.get('input')!r})") from None


def env_names(cls: type[BaseSettings]) -> list[str]:
    """The variables ``cls`` reads, e.g. ['SLUICE_HOME', 'SLUICE_REDIS_URL']."""
    return [ENV_PREFIX + name.upper() for name in cls.model_fields]


def job_plane() -> JobPlaneSettings:
    return load(JobPlaneSettings)


# ---- retries: how often a job is delivered, how fast a dead worker's jobs are taken, the backoff ---------
DEFAULT_MAX_DELIVERIES = 3
MAX_MAX_DELIVERIES = 100
DEFAULT_HEARTBEAT_TTL = 10.0  # seconds
HEARTBEAT_TTL_RANGE = (1.0, 3600.0)
# A job that failed an attempt waits RETRY_BACKOFF * 2**(attempts - 1) seconds, at most RETRY_BACKOFF_MAX,
# before it runs again: 1 s, 2 s, 4 s, ... 60 s.
RETRY_BACKOFF = 1.0
RETRY_BACKOFF_MAX = 60.0
# The batch metadata key that sets a batch's own max deliveries (`sluice submit --max-deliveries`, the API's
# metadata): the one sluice_* key a client may set.
MAX_DELIVERIES_KEY = "sluice_max_deliveries"


def retry_backoff(attempts: int) -> float:
    """Seconds a job that failed its ``attempts``-th delivery waits before the next one."""
    return min(RETRY_BACKOFF * 2 ** max(attempts - 1, 0), RETRY_BACKOFF_MAX)


def parse_max_deliveries(value: object) -> int:
    """A max-deliveries setting (flag, variable or metadata value); a ValueError says what is wrong."""
    try:
        n = int(str(value).strip())
    except ValueError:
        raise ValueError(f"max deliveries must be a whole number, not {value!r}") from None
    if not 1 <= n <= MAX_MAX_DELIVERIES:
        raise ValueError(f"max deliveries must be between 1 and {MAX_MAX_DELIVERIES}, not {n}")
    return n


def parse_heartbeat_ttl(value: object) -> float:
    """A heartbeat TTL in seconds; a ValueError says what is wrong."""
    try:
        ttl = float(str(value).strip())
    except ValueError:
        raise ValueError(f"heartbeat TTL must be a number of seconds, not {value!r}") from None
    low, high = HEARTBEAT_TTL_RANGE
    if not low <= ttl <= high:  # also refuses nan and inf
        raise ValueError(f"heartbeat TTL must be between {low:g} and {high:g} seconds, not {value}")
    return ttl


@dataclass(frozen=True)
class WorkerFlag:
    """A worker option that ``sluice worker``/``sluice up`` (click) and ``python -m sluice.worker``
    (argparse) both take: spelled once here, with its variable and its parser."""

    flag: str
    envvar: str
    parse: Callable[[object], Any]
    help: str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    def from_env(self) -> Any:
        """The variable's value, parsed (None when unset or empty); a bad one is a SettingsError line."""
        raw = os.environ.get(self.envvar, "")
        if not raw.strip():
            return None
        try:
            return self.parse(raw)
        except ValueError as e:
            raise SettingsError(f"{self.envvar}: {e}") from None


RETRY_FLAGS = (
    WorkerFlag("--max-deliveries", "SLUICE_MAX_DELIVERIES", parse_max_deliveries,
               f"Deliveries of a job before it is dead-lettered (failed, listed by `sluice dead-letters`) "
               f"[default: {DEFAULT_MAX_DELIVERIES}; a batch's metadata {MAX_DELIVERIES_KEY} wins]."),
    WorkerFlag("--heartbeat-ttl", "SLUICE_HEARTBEAT_TTL", parse_heartbeat_ttl,
               f"Seconds without a heartbeat before other workers take this worker's jobs "
               f"[default: {DEFAULT_HEARTBEAT_TTL:g}]."),
)
