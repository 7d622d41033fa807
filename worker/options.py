"""What a worker is told (WorkerOptions) and what it reports when it stops (WorkerReport).

WorkerOptions holds the one set of defaults: ``run_worker``, ``python -m sluice.worker`` and ``sluice worker``
pass on only what they were given."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

from sluice.engine.protocol import Engine
from sluice.jobs.consumer.session import SessionSettings, SessionStats
from sluice.jobs.housekeeping import RESULTS_TTL
from sluice.jobs.settings import DEFAULT_HEARTBEAT_TTL, DEFAULT_MAX_DELIVERIES

EngineFactory = Callable[[], Engine]


@dataclass
class WorkerOptions:
    queue: str
    worker_id: str | None = None  # default: "<host>/<device>", suffixed -2, -3... while taken
    redis_url: str | None = None  # default: SLUICE_REDIS_URL, else the embedded server
    lookahead: int | None = None  # default: 10% of max_num_seqs, at least 2
    max_deliveries: int = DEFAULT_MAX_DELIVERIES
    heartbeat_ttl: float = DEFAULT_HEARTBEAT_TTL
    claim_interval: float | None = None  # default: heartbeat_ttl / 2
    grace_period: float = 30.0
    metrics_port: int | None = None
    housekeeping_interval: float = 30.0
    results_ttl: float = RESULTS_TTL
    poll_interval: float = 0.05  # idle wait between looks at the queue
    exit_when_idle: float | None = None  # stop after this many seconds with nothing to do
    stall_after: float = 600.0  # a step loop stuck this long (a hung engine) lets the heartbeat lapse

    @property
    def session(self) -> SessionSettings:
        names = {f.name for f in fields(SessionSettings)}
        return SessionSettings(**{k: v for k, v in vars(self).items() if k in names})


@dataclass
class WorkerReport:
    worker_id: str = ""
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    dead_lettered: int = 0
    released: int = 0  # handed back to the queue at shutdown
    claimed: int = 0
    tokens: int = 0
    steps: int = 0
    step_failures: int = 0
    lost: int = 0  # jobs another worker took while our heartbeat had lapsed
    sick: str = ""  # why the engine was judged sick (the worker then exits non-zero)
    max_held: int = 0
    wall_s: float = 0.0

    def merge(self, s: SessionStats) -> None:
        """The session's tallies: outcomes written fresh by status, claimed, dead-lettered, released."""
        for name in ("completed", "failed", "cancelled", "expired", "dead_lettered", "released", "claimed"):
            setattr(self, name, getattr(self, name) + getattr(s, name))
