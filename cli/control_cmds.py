"""Commands that steer a queued batch (pause, resume) and list batch events with their webhook deliveries."""

from __future__ import annotations

import json
import time

import click
from sluice.cli.common import UserError, job_server_errors, open_server, require_batch
from sluice.cli.queue_cmds import _print_json, json_option
from sluice.jobs.pause import NotPausable, pause_batch, resume_batch
from sluice.jobs.schemas import Batch
from sluice.jobs.store import get_batch
from sluice.jobs.webhooks import batch_events, recent_events


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


@click.command("events")
@click.argument("batch_id", required=False)
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True, help="Without BATCH_ID: events "
              "of the most recently finished batches.")
@click.option("--json", "as_json", is_flag=True, help="One event object per line, with its delivery.")
@job_server_errors
def events_cmd(batch_id: str | None, limit: int, as_json: bool) -> None:
    """Batch events (batch.completed, batch.failed, batch.expired, batch.cancelled) and their webhook
    deliveries: state, attempts, last error. The API server sends them (SLUICE_WEBHOOK_URL)."""
    r = open_server()
    if batch_id is not None:
        require_batch(get_batch(r, batch_id, max_errors=0), batch_id)
    events = batch_events(r, batch_id) if batch_id is not None else recent_events(r, limit)
    if as_json:
        for e in events:
            click.echo(json.dumps(e.to_dict(), separators=(",", ":")))
        return
    if not events:
        click.echo("no events", err=True)
        return
    click.echo(f"{'EVENT':<28} {'TYPE':<16} {'BATCH':<32} {'CREATED':<19}  {'DELIVERY':<9} {'TRIES':>5}  LAST ERROR")
    for e in events:
        d = e.delivery
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.created_at))
        click.echo(f"{e.id:<28} {e.type:<16} {e.batch_id:<32} {created}  {d.state:<9} {d.attempts:>5}  "
                   f"{d.last_error or '-'}")
