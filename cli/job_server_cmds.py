"""``sluice server status|start|stop|repair``: the job server's lifecycle made visible.

Commands that need the job server start the embedded one (in SLUICE_HOME) when SLUICE_REDIS_URL is
unset and leave it running, so later commands find their batches; these commands show it and stop it.
An external server (SLUICE_REDIS_URL) can be shown but is not sluice's to start or stop. ``repair``
mends an embedded server's append-only file that would not load (``sluice.jobs.aof``).
"""

from __future__ import annotations

import json
from typing import Any

import click
import redis
from sluice.cli.common import (
    EXIT_SERVER_DOWN,
    UserError,
    announce_start,
    job_server_errors,
    open_server,
    server_name,
)
from sluice.jobs import aof
from sluice.jobs.connection import (
    ENV_URL,
    EmbeddedServer,
    connect,
    data_dir,
    ensure_server,
    external_url,
    find_server,
    stop_server,
)
from sluice.jobs.store import count_batches


@click.group("server")
def server_cmd() -> None:
    """The job server: where it runs, and starting or stopping the embedded one."""


def _facts(r: redis.Redis) -> dict[str, Any]:
    info = r.info()
    return {"version": info.get("valkey_version") or info.get("redis_version"),
            "used_memory": info["used_memory"], "used_memory_rss": info.get("used_memory_rss"),
            "batches": count_batches(r)}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


@server_cmd.command("status")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@job_server_errors
def server_status(as_json: bool) -> None:
    """Where the job server runs, its data directory, pid, memory and how many batches it holds.
    Exits 4 when it is not running (or, for SLUICE_REDIS_URL, unreachable)."""
    url = external_url()
    status: dict[str, Any] = {"server": server_name(), "embedded": url is None}
    if url is None:
        found = find_server()
        status.update(data_dir=str(data_dir()), running=found is not None)
        if found is not None:
            status.update(pid=found.pid, address=f"127.0.0.1:{found.port}")
            status.update(_facts(connect(found.url)))
    else:
        status.update(running=True, **_facts(open_server()))  # unreachable: one line, exit 4
    if as_json:
        click.echo(json.dumps(status))
    else:
        click.echo(_status_text(status))
    if not status["running"]:
        raise SystemExit(EXIT_SERVER_DOWN)


def _status_text(s: dict[str, Any]) -> str:
    if not s["running"]:
        return f"{s['server']}: not running (data in {s['data_dir']}); `sluice server start` starts it"
    rows = [("address", s.get("address")), ("pid", s.get("pid")), ("data", s.get("data_dir")),
            ("version", s["version"]), ("memory", f"{_mib(s['used_memory'])} used, {_mib(s['used_memory_rss'])} "
                                                   "resident"), ("batches", s["batches"])]
    return "\n".join([f"{s['server']}: running", *(f"  {k:<8} {v}" for k, v in rows if v is not None)])


def _embedded_only(action: str) -> None:
    if external_url() is not None:
        raise UserError(f"{ENV_URL} is set: that job server is not sluice's to {action} "
                        "(unset it to use the embedded one)")


@server_cmd.command("start")
def server_start() -> None:
    """Start the embedded job server of SLUICE_HOME (nothing to do if it runs)."""
    _embedded_only("start")
    started: list[bool] = []

    def on_start(s: EmbeddedServer) -> None:
        started.append(True)
        announce_start(s)

    try:
        server = ensure_server(on_start=on_start)
    except RuntimeError as e:
        raise UserError(f"cannot start {server_name()}: {e}") from None
    if not started:
        click.echo(f"already running (pid {server.pid}, 127.0.0.1:{server.port}, data in {server.home})", err=True)


@server_cmd.command("stop")
def server_stop() -> None:
    """Stop the embedded job server of SLUICE_HOME (its data stays; any command starts it again)."""
    _embedded_only("stop")
    found = find_server()
    if found is None or not stop_server():
        click.echo(f"{server_name()}: not running", err=True)
        return
    click.echo(f"stopped the embedded job server (pid {found.pid}); its data stays in {found.home}", err=True)


@server_cmd.command("repair")
@click.option("--yes", is_flag=True, help="Repair without asking.")
def server_repair(yes: bool) -> None:
    """Mend the embedded job server's append-only file when it will not load: cut a torn record and what
    follows it, or list increment files the manifest left out. A copy of the directory is kept first."""
    _embedded_only("repair")
    found = find_server()
    if found is not None:
        raise UserError(f"the embedded job server is running (pid {found.pid}): its data loaded, nothing to repair")
    directory = data_dir() / aof.DIRNAME
    try:
        problem = aof.find_problem(directory)
        if problem is None:
            click.echo(f"the append-only file in {directory} is sound: nothing to repair", err=True)
            return
        click.echo(problem.describe(), err=True)
        if not yes and not click.confirm("Repair it now?", err=True):
            raise UserError("nothing was changed")
        fixed, backup = aof.repair(directory)
    except (aof.AofUnrepairable, OSError) as e:
        raise UserError(f"cannot repair {directory}: {e}") from None
    for p in fixed:
        done = (f"listed {', '.join(p.unlisted)} again" if p.kind == "unlisted" else
                f"cut {p.file} to {p.good_up_to} bytes" + (f", dropped {', '.join(p.later)}" if p.later else ""))
        click.echo(f"repaired: {done}", err=True)
    click.echo(f"the directory as it was is kept in {backup}; `sluice server start` starts the server", err=True)
