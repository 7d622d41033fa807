"""Commands that steer a queued batch: pause, resume."""

from __future__ import annotations

import click
from sluice.cli.common import UserError, job_server_errors, open_server, require_batch
from sluice.cli.queue_cmds import _print_json, json_option
from sluice.jobs.pause import NotPausable, pause_batch, resume_batch
from sluice.jobs.schemas import Batch


@click.command("pause")
@click.argument("batch_id")
@click.option("--now", is_flag=True, help="Also put its running requests back in the queue (not counted as an "
              "attempt) instead of letting them finish.")
@json_option
@job_server_errors
def pause_cmd(batch_id: str, now: bool, as_json: bool) -> None:
    """Pause a batch: workers take none of its requests until `sluice resume` (running ones finish)."""
    try:
        batch = require_batch(pause_batch(open_server(), batch_id, now), batch_id)
    except NotPausable as e:
        raise UserError(str(e)) from None
    _say(batch, as_json, "paused" + (": its running requests go back to the queue" if now else ""))


@click.command("resume")
@click.argument("batch_id")
@json_option
@job_server_errors
def resume_cmd(batch_id: str, as_json: bool) -> None:
    """Resume a paused batch: workers take its requests again."""
    _say(require_batch(resume_batch(open_server(), batch_id), batch_id), as_json, "resumed")


def _say(batch: Batch, as_json: bool, what: str) -> None:
    if as_json:
        _print_json(batch.to_openai())
        return
    c = batch.counts
    click.echo(f"{batch.id} {batch.status}, {what}: {c.done}/{c.total} done")
