"""Datasets in, datasets out: rows of a Parquet / CSV / JSONL file, a ``datasets.save_to_disk``
directory or a Hub dataset, at any fsspec URL, become request lines; results come back as the source's
rows with result columns added.

The seam with the rest of Sluice is JSONL text: ``read_requests`` yields one simple request line per
row (or a ``RowError`` naming the row), which ``sluice.jobs.submit.submit`` and ``sluice generate`` take as
they take a file's lines; ``ResultsWriter`` takes the OpenAI batch output lines they produce.

Bounded memory (why the writer reads the source twice): results land in any order, so each one is
kept in a small on-disk journal (SQLite) keyed by custom_id. The writer reads the source again, one
record batch (= one output row group) at a time, and writes that group as soon as each of its rows has
a result or a row error; results of later rows wait in the journal, not in memory. The journal is also
what ``resume`` reads: the rows it holds are not sent again, and the output is rewritten from it.

Needs the ``datasets`` extra (pyarrow, fsspec, datasets); object storage needs ``s3`` (s3fs).
"""

from __future__ import annotations

from sluice.jobs.datasets.extras import MissingExtra, need

need("pyarrow")
need("fsspec")

from sluice.jobs.datasets.readers import Block, Source, SourceError, open_data, open_source  # noqa: E402
from sluice.jobs.datasets.rows import Request, RowError, RowSpec, SpecError, read_requests  # noqa: E402
from sluice.jobs.datasets.writers import ResultsWriter, WriteSummary  # noqa: E402

__all__ = ["Block", "MissingExtra", "Request", "ResultsWriter", "RowError", "RowSpec", "Source", "SourceError",
           "SpecError", "WriteSummary", "open_data", "open_source", "read_requests"]
