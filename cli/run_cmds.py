"""Long-running commands: ``worker`` (one per accelerator), ``serve`` (the HTTP API) and ``up`` (the
embedded job server, one worker and the API in one foreground process, for a laptop)."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click
import redis
from sluice.cli.common import (
    ServerDown,
    UserError,
    job_server_errors,
    need_engine,
    one_line,
    open_server,
    server_name,
)
from sluice.cli.options import Parsed, env_option, with_engine_options
from sluice.jobs.connection import EmbeddedServer, stop_server
from sluice.jobs.settings import RETRY_FLAGS, load
from sluice.jobs.store import served_queues

worker_options = [
    env_option("--queue", envvar="SLUICE_QUEUE", default=None, help="The model name clients ask for [default: the "
               "--model string, or 'default' without one]."),
    env_option("--metrics-port", envvar="SLUICE_METRICS_PORT", type=click.IntRange(1, 65535), default=None,
               help="Serve the worker's Prometheus metrics on this port."),
    # Spelled here as well as in WorkerOptions: the CLI imports without the worker (tests/project/test_deploy.py).
    env_option("--grace-period", envvar="SLUICE_GRACE_PERIOD", type=click.FloatRange(min=0), default=30.0,
               show_default=True, help="Seconds to finish running jobs after Ctrl-C/SIGTERM (a second one stops at "
               "once)."),
    # --max-deliveries, --heartbeat-ttl: spelled once in jobs/settings.py (python -m sluice.worker takes them too).
    *(env_option(f.flag, envvar=f.envvar, type=Parsed(f.dest, f.parse), default=None, help=f.help)
      for f in RETRY_FLAGS),
]


def with_worker_options(f: Any) -> Any:
    for option in reversed(worker_options):
        f = option(f)
    return f


def _given(**opts: Any) -> dict[str, Any]:
    """The worker options given; the rest keep WorkerOptions' defaults."""
    return {k: v for k, v in opts.items() if v is not None}


def _run_worker(model: str | None, engine: dict[str, Any], **opts: Any) -> Any:
    from sluice.worker import run_worker  # torch and the engine load only for the commands that run one

    try:
        return run_worker(model, **opts, **engine)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot start the worker: {one_line(e)}") from None


@click.command("worker")
@with_engine_options
@with_worker_options
@env_option("--worker-id", envvar="SLUICE_WORKER_ID", default=None, help="[default: <host>/<device>]")
@click.option("--exit-when-idle", type=click.FloatRange(min=0), default=None,
              help="Stop after this many seconds with nothing to do.")
@job_server_errors
def worker_cmd(model: str | None, engine: dict[str, Any], queue: str | None, metrics_port: int | None,
               grace_period: float, max_deliveries: int | None, heartbeat_ttl: float | None, worker_id: str | None,
               exit_when_idle: float | None) -> None:
    """Pull jobs for one model from the queue into the engine until Ctrl-C/SIGTERM (then drain)."""
    need_engine(model)
    open_server().ping()  # the job server first: an unreachable one is reported before the model loads
    report = _run_worker(model, engine, queue=queue, worker_id=worker_id, metrics_port=metrics_port,
                         grace_period=grace_period, exit_when_idle=exit_when_idle,
                         **_given(max_deliveries=max_deliveries, heartbeat_ttl=heartbeat_ttl))
    click.echo(json.dumps(asdict(report)), err=True)


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def serve_cmd(host: str, port: int, log_level: str) -> None:
    """The HTTP API (OpenAI Files + Batches, native jobs and results) under uvicorn.

    SLUICE_API_KEY, when set, is the bearer token every /v1 request needs."""
    import uvicorn
    from sluice.api.app import create_app
    from sluice.api.settings import Settings

    load(Settings)  # a bad SLUICE_* value is one line now, not a traceback from uvicorn's factory call
    _check_job_server()
    sock = _bind(host, port)
    click.echo(f"Sluice API on http://{host}:{sock.getsockname()[1]}/v1 (docs at /docs); job server: "
               f"{server_name()}", err=True)
    try:
        uvicorn.Server(uvicorn.Config(create_app, factory=True, log_level=log_level)).run(sockets=[sock])
    except KeyboardInterrupt:
        pass  # uvicorn re-raises the Ctrl-C it shut down on; that is the normal way to stop


def _check_job_server() -> None:
    """Start (or find) the job server now, so the first request does not wait for it; only warn if it is
    down, since the API reports that itself (503, /healthz) and recovers when it is back."""
    try:
        open_server().ping()
    except (redis.RedisError, ServerDown) as e:
        click.echo(f"warning: the job server is unreachable ({server_name()}): {one_line(e)}", err=True)


def _bind(host: str, port: int) -> socket.socket:
    """The API's socket, bound now so a taken port is an error before anything else starts, and listening,
    so clients that come before uvicorn does wait in the backlog rather than being refused."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or one_line(e)}") from None
    sock.listen(2048)
    return sock


class ApiThread:
    """uvicorn in a thread of this process, opened once a worker is live (requests naming no model are
    routed by which models live workers serve, so none should be taken before one is)."""

    def __init__(self, sock: socket.socket, log_level: str = "warning") -> None:
        import uvicorn
        from sluice.api.app import create_app

        self.sock = sock
        self.server = uvicorn.Server(uvicorn.Config(create_app, factory=True, log_level=log_level))
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sluice-api", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        r = open_server()
        while not self.stop_event.is_set():
            try:
                if served_queues(r):
                    break
            except redis.RedisError:
                pass
            self.stop_event.wait(0.2)
        else:
            return
        host, port = self.sock.getsockname()[:2]
        click.echo(f"Sluice API ready on http://{host}:{port}/v1 (docs at /docs); Ctrl-C stops everything", err=True)
        self.server.run(sockets=[self.sock])

    def stop(self) -> None:
        self.stop_event.set()
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@click.command("up")
@with_engine_options
@with_worker_options
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@job_server_errors
def up_cmd(model: str | None, engine: dict[str, Any], queue: str | None, metrics_port: int | None,
           grace_period: float, max_deliveries: int | None, heartbeat_ttl: float | None, host: str, port: int) -> None:
    """The embedded job server, one worker and the API in one foreground command; Ctrl-C stops all.

    The job server is stopped at the end only if this command started it (its data stays in SLUICE_HOME)."""
    need_engine(model)
    started: list[EmbeddedServer] = []

    def note_start(server: EmbeddedServer) -> None:
        started.append(server)
        click.echo(f"started the embedded job server (pid {server.pid}); it stops with this command", err=True)

    open_server(on_start=note_start).ping()
    sock = _bind(host, port)
    api = ApiThread(sock)
    api.start()
    click.echo(f"loading {model or 'the default model'}; job server: {server_name()}", err=True)
    t0 = time.monotonic()
    try:
        report = _run_worker(model, engine, queue=queue, metrics_port=metrics_port, grace_period=grace_period,
                             **_given(max_deliveries=max_deliveries, heartbeat_ttl=heartbeat_ttl))
        click.echo(f"worker stopped after {time.monotonic() - t0:.0f}s: {report.completed} completed, "
                   f"{report.failed} failed", err=True)
    except KeyboardInterrupt:  # before the worker took over Ctrl-C (while the model loaded)
        click.echo("interrupted", err=True)
    finally:
        api.stop()
        if started:  # what this command started, and nothing that was running before it
            stop_server(Path(started[0].home))
