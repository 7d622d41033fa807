"""``sluice.submit`` and ``sluice.Batch``: rows queued on the job server, watched, waited for, and read
back joined to their source rows."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import redis

from sluice.data import Data, joined, like, row_spec, sampling_defaults, source_of
from sluice.jobs.datasets import RowError, RowSpec, Source, WriteSummary
from sluice.jobs.datasets.queue import join_results, submit_rows
from sluice.jobs.pause import pause_batch, resume_batch
from sluice.jobs.reopen import Reopened, requeue_dead_letters, retry_batch
from sluice.jobs.schemas import Batch as BatchStatus
from sluice.jobs.store import cancel_batch, dead_letters, get_batch, output_lines


class Batch:
    """A batch on the job server, with the rows it came from.

    ``status()`` is its state now; ``wait()`` blocks until it ends (a progress bar by default);
    ``results()`` yields OpenAI batch output lines as they land; ``to_arrow()`` / ``to_pandas()`` /
    ``to_polars()`` / ``to_dataset()`` / ``write(url)`` wait, then give every source row with its result
    columns. The source is read again for the join, so keep a file in place (or the data alive).
    """

    def __init__(self, batch_id: str, source: Source, spec: RowSpec, row_errors: list[RowError],
                 r: redis.Redis, data: Data = None) -> None:
        self.id = batch_id
        self.source = source
        self.spec = spec
        self.row_errors = row_errors  # rows that were not queued (they did not render), with why
        self.r = r
        self._data = data

    def __repr__(self) -> str:
        return f"sluice.Batch({self.id!r})"

    def status(self) -> BatchStatus:
        batch = get_batch(self.r, self.id)
        if batch is None:
            raise LookupError(f"batch {self.id} is gone from the job server (deleted or expired)")
        return batch

    def wait(self, timeout: float | None = None, progress: bool = True, poll: float = 0.5) -> BatchStatus:
        """Block until the batch ends (completed, failed, expired or cancelled); TimeoutError after
        ``timeout`` seconds."""
        from tqdm import tqdm

        start = time.monotonic()
        batch = self.status()
        bar = tqdm(total=batch.counts.total, unit="req", desc=self.id, disable=not progress)
        try:
            while True:
                bar.total = batch.counts.total
                bar.update(batch.counts.done - bar.n)
                if batch.is_final:
                    return batch
                if timeout is not None and time.monotonic() - start > timeout:
                    raise TimeoutError(f"batch {self.id} still {batch.status} after {timeout:g} s")
                time.sleep(poll)
                batch = self.status()
        finally:
            bar.close()

    def results(self, follow: bool = False) -> Iterator[dict[str, Any]]:
        """OpenAI batch output lines in completion order; ``follow`` waits for more until it ends."""
        return output_lines(self.r, self.id, follow=follow)

    def cancel(self) -> BatchStatus:
        cancel_batch(self.r, self.id)
        return self.status()

    def dead_letters(self) -> list[dict[str, Any]]:
        """The jobs given up on after max deliveries (custom_id, last error, deliveries, the job)."""
        return dead_letters(self.r, self.id)

    def requeue(self, custom_ids: list[str] | None = None) -> BatchStatus:
        """Run dead-lettered jobs again (``custom_ids``; None: all); each new outcome replaces its failure.
        A custom_id without a dead letter raises ValueError (nothing is requeued then)."""
        return self._reopened(requeue_dead_letters(self.r, self.id, custom_ids))

    def retry(self) -> BatchStatus:
        """Run the failed and expired rows of this finished batch again; ``wait()`` then sees them succeed
        (or fail again) in place of the old outcomes. ValueError if the batch is not completed or expired."""
        return self._reopened(retry_batch(self.r, self.id))

    def _reopened(self, done: Reopened | None) -> BatchStatus:
        if done is None:
            raise LookupError(f"batch {self.id} is gone from the job server (deleted or expired)")
        return done.batch

    def pause(self, now: bool = False) -> BatchStatus:
        """No new row of it goes to a worker until ``resume()``; running ones finish (``now``: they go back
        to the queue, not counted as an attempt)."""
        pause_batch(self.r, self.id, now)
        return self.status()

    def resume(self) -> BatchStatus:
        resume_batch(self.r, self.id)
        return self.status()

    def write(self, output: str, *, timeout: float | None = None, progress: bool = True,
              **writer: Any) -> WriteSummary:
        """Wait, then write every source row with its result columns to ``output`` (.parquet, .jsonl,
        .csv; any fsspec URL)."""
        self.wait(timeout, progress)
        with joined(self.source, self.spec, output, **writer) as (w, _):
            return join_results(self.r, self.id, w, self.row_errors)

    def to_arrow(self, *, timeout: float | None = None, progress: bool = True) -> Any:
        """Wait, then every source row with its result columns, as a pyarrow Table."""
        self.wait(timeout, progress)
        with joined(self.source, self.spec, None) as (w, table):
            join_results(self.r, self.id, w, self.row_errors)
            return table()

    def to_pandas(self, **kw: Any) -> Any:
        return self.to_arrow(**kw).to_pandas()

    def to_polars(self, **kw: Any) -> Any:
        import polars

        return polars.from_arrow(self.to_arrow(**kw))

    def to_dataset(self, **kw: Any) -> Any:
        import datasets

        return datasets.Dataset(self.to_arrow(**kw))

    def to_data(self, **kw: Any) -> Any:
        """The results in the kind of data submitted (a DataFrame for a DataFrame, ...)."""
        return like(self.to_arrow(**kw), self._data)



def submit(data: Data, *, model: str | None = None, prompt_column: str | None = None,
           messages_column: str | None = None, template: str | None = None, template_file: str | None = None,
           system: str | None = None, id_column: str | None = None, model_column: str | None = None,
           image_column: str | None = None, chat: bool = True, priority: int = 0,
           metadata: dict[str, str] | None = None, r: redis.Redis | None = None,
           storage_options: dict[str, Any] | None = None, **sampling: Any) -> Batch:
    """Queue every row of ``data`` (see ``sluice.generate`` for the row options) on the job server
    (SLUICE_REDIS_URL, or the embedded one); returns the Batch at once, before any result. Rows that
    do not render are not queued: ``Batch.row_errors`` says why, and the joined results carry them."""
    from sluice.jobs.connection import connect

    source = source_of(data, storage_options)
    spec = row_spec(prompt_column, messages_column, template, template_file, system, id_column, chat, model_column,
                    image_column)
    defaults = sampling_defaults(sampling)
    r = r or connect()
    batch, row_errors = submit_rows(source, spec, r, model=model, defaults=defaults, priority=priority,
                                    metadata=metadata)
    return Batch(batch.id, source, spec, row_errors, r, data)
