"""Exit codes, opening the job server (saying so when a command starts the embedded one), and turning
its failures into one-line errors."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click
import redis
from sluice.jobs.connection import (
    ENV_URL,
    EmbeddedServer,
    OnStart,
    connect,
    external_url,
    redis_url,
    sluice_home,
)
from sluice.jobs.schemas import Batch
from sluice.jobs.settings import SettingsError

EXIT_USER_ERROR = 1
EXIT_USAGE = 2  # click's own: unknown option, missing argument, bad option value
EXIT_SOME_FAILED = 3
EXIT_SERVER_DOWN = 4
EXIT_INTERRUPTED = 130

F = TypeVar("F", bound=Callable[..., Any])


class UserError(click.ClickException):
    exit_code = EXIT_USER_ERROR


class ServerDown(click.ClickException):
    exit_code = EXIT_SERVER_DOWN


def one_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def server_name() -> str:
    """Where the job server is, without its password."""
    url = external_url()
    if url:
        u = urlsplit(url)
        return f"{u.scheme}://{u.hostname}:{u.port or 6379} ({ENV_URL})"
    return f"the embedded server of {sluice_home()} (SLUICE_HOME)"


def announce_start(server: EmbeddedServer) -> None:
    """The one line a command prints when it starts the embedded server, which outlives it."""
    click.echo(f"started the embedded job server (pid {server.pid}, 127.0.0.1:{server.port}, data in "
               f"{server.home}); it keeps running: `sluice server stop` stops it", err=True)


def open_server(on_start: OnStart | None = announce_start) -> redis.Redis:
    """A client of the job server; the embedded one is started if it is not running (its data is on disk)."""
    try:
        return connect(redis_url(on_start=on_start))
    except SettingsError as e:
        raise UserError(str(e)) from None
    except RuntimeError as e:  # the embedded server would not start
        raise ServerDown(f"cannot start {server_name()}: {one_line(e)}") from None


def job_server_errors(f: F) -> F:
    """A command whose job server is unreachable exits EXIT_SERVER_DOWN with one line, no traceback."""

    @functools.wraps(f)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return f(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise ServerDown(f"cannot reach the job server at {server_name()}: {one_line(e)}") from None
        except redis.ResponseError as e:
            raise ServerDown(f"the job server at {server_name()} refused: {one_line(e)}") from None

    return wrapper  # type: ignore[return-value]


def require_batch(batch: Batch | None, batch_id: str) -> Batch:
    if batch is None:
        raise UserError(f"no batch {batch_id!r} (`sluice batches` lists them)")
    return batch


def need_engine(model: str | None = None) -> None:
    """The model code is the `worker` extra; a command that runs it says so in one line when it is missing
    (the API's image, or `pip install sluice-llm[api]`, has none). Before torch loads: an embedding
    ``model``'s OpenMP threads spin briefly (engine/omp_spin.py)."""
    try:
        from sluice.engine.omp_spin import is_embedding_model, short_omp_spin

        if is_embedding_model(model):
            short_omp_spin()
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise UserError(f"this command runs the engine, which needs {e.name or 'torch'}: "
                        "pip install 'sluice-llm[worker]'") from None


def interrupted(message: str) -> None:
    click.echo(message, err=True)
    sys.exit(EXIT_INTERRUPTED)
