"""Commands that run failed jobs again (issue 43): ``dead-letters`` (list), ``requeue`` (dead letters back on
the queue) and ``retry`` (a finished batch's failed and expired lines). ``jobs/reopen.py`` does the work."""

from __future__ import annotations

from collections.abc import Callable

import click
from sluice.cli.common import UserError, job_server_errors, open_server, require_batch
from sluice.cli.queue_cmds import _print_json, json_option
from sluice.jobs.reopen import Reopened, ReopenRefused, dead_letter_entries, requeue_dead_letters, retry_batch
from sluice.jobs.store import get_batch


@click.command("dead-letters")
@click.argument("batch_id")
@click.option("--json", "as_json", is_flag=True, help="One dead letter per line as JSON (the queued job included).")
@job_server_errors
def dead_letters_cmd(batch_id: str, as_json: bool) -> None:
    """List BATCH's dead letters: jobs given up on after --max-deliveries deliveries, with the last error.
    `sluice requeue BATCH` runs them again."""
    r = open_server()
    require_batch(get_batch(r, batch_id, max_errors=0), batch_id)
    dead = [dl for _, dl in dead_letter_entries(r, batch_id)]
    if as_json:
        for dl in dead:
            _print_json(dl.model_dump())
        return
    if not dead:
        click.echo(f"no dead letters in {batch_id}", err=True)
        return
    click.echo(f"{'CUSTOM_ID':<24} {'DELIVERIES':>10}  {'WORKER':<20} LAST ERROR")
    for dl in dead:
        click.echo(f"{dl.custom_id:<24} {dl.deliveries:>10}  {dl.worker:<20} {dl.error.splitlines()[0][:200]}")


@click.command("requeue")
@click.argument("batch_id")
@click.option("--ids", "custom_ids", multiple=True, default=None, metavar="CUSTOM_ID",
              help="A dead-lettered job to run again, by custom_id (repeatable).")
@click.option("--all", "everything", is_flag=True, help="Every dead letter of the batch.")
@json_option
@job_server_errors
def requeue_cmd(batch_id: str, custom_ids: tuple[str, ...] | None, everything: bool, as_json: bool) -> None:
    """Put BATCH's dead-lettered jobs back on the queue, keeping their custom_ids; each one's new outcome
    replaces its failure (counts, results and the error file say it ran once)."""
    if everything == bool(custom_ids):
        raise click.UsageError("give --ids CUSTOM_ID ... or --all")
    r = open_server()
    done = _or_refused(lambda: requeue_dead_letters(r, batch_id, None if everything else list(custom_ids or ())), batch_id)
    _report(done, "requeued", as_json)


@click.command("retry")
@click.argument("batch_id")
@json_option
@job_server_errors
def retry_cmd(batch_id: str, as_json: bool) -> None:
    """Run the failed and expired lines of finished BATCH again from their stored input: its output then
    holds each custom_id once, as if they had succeeded the first time (`sluice results` when it ends)."""
    r = open_server()
    _report(_or_refused(lambda: retry_batch(r, batch_id), batch_id), "queued again", as_json)


def _or_refused(run: Callable[[], Reopened | None], batch_id: str) -> Reopened:
    try:
        done = run()
    except ReopenRefused as e:
        raise UserError(str(e)) from None
    require_batch(None if done is None else done.batch, batch_id)
    assert done is not None
    return done


def _report(done: Reopened, verb: str, as_json: bool) -> None:
    if as_json:
        _print_json({**done.batch.to_openai(), "queued": done.queued, "not_retryable": done.not_retryable})
        return
    b = done.batch
    click.echo(f"{b.id}: {done.queued} jobs {verb}; now {b.status}, {b.counts.done}/{b.counts.total} done")
    if done.not_retryable:
        click.echo(f"{done.not_retryable} failed jobs have no stored input (unreadable queue entries) and stay "
                   "failed", err=True)
job_control_cmds = (dead_letters_cmd, requeue_cmd, retry_cmd)
