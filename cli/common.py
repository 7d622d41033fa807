"""Exit codes, and turning the job server's failures into one-line errors."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import click
import redis

from jobs.schemas import Batch
from jobs.server import ENV_URL, connect, redis_url, sluice_home

EXIT_USER_ERROR = 1
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
    url = os.environ.get(ENV_URL)
    if url:
        u = urlsplit(url)
        return f"{u.scheme}://{u.hostname}:{u.port or 6379} ({ENV_URL})"
    return f"the embedded server of {sluice_home()} (SLUICE_HOME)"


def open_server() -> redis.Redis:
    """A client of the job server; the embedded one is started if it is not running (its data is on disk)."""
    try:
        return connect(redis_url())
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


def interrupted(message: str) -> None:
    click.echo(message, err=True)
    sys.exit(EXIT_INTERRUPTED)
