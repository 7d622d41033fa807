"""ResultsWriter: results (OpenAI batch output lines, any order) + their source rows -> the output
dataset (Parquet, JSONL or CSV at any fsspec URL), in source order, one row group at a time.

The merge (memory bounded by one row group): each result goes to the journal (SQLite, on disk). The
source is read again a block at a time; the block due next is written as soon as every row of it has a
result or a row error, then the next block is read. Rows that finish early wait in the journal. A
Parquet output is a valid file once closed; a run killed before that leaves the journal, and
``resume=True`` rewrites the output from it while ``done()`` tells the reader which rows to skip.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import platformdirs
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
from sluice.jobs.datasets.journal import Journal
from sluice.jobs.datasets.readers import (
    DEFAULT_ROWS,
    Block,
    Source,
    SourceError,
    csv_rows,
    format_of_name,
    json_default,
    open_source,
    url_to_fs,
)
from sluice.jobs.datasets.results import (
    NO_RESULT,
    columns_from_output_row,
    error_columns,
    result_columns,
    result_fields,
)
from sluice.jobs.datasets.rows import RowError, RowSpec, safe_row_id

OUTPUT_FORMATS = ("parquet", "jsonl", "csv")


@dataclass
class WriteSummary:
    rows: int = 0  # rows written
    completed: int = 0  # rows with a result and no error
    failed: int = 0  # rows with an error (a failed request or a row that did not render)
    no_result: int = 0  # rows the run ended without (error code no_result): a resume runs them


class ResultsWriter:
    """Joins results with their source rows and writes the output as results land.

    Feed it every item of ``read_requests``' RowErrors (``add_error``) as they are read, and every
    result line (``add``); ``close()`` writes what is left (rows still without a result get the error
    ``no_result``) and removes the journal. Used as a context manager, an exception leaves the journal
    for a resume. Results are stored by custom_id, so with ``spec.id_column`` the ids must be unique
    (``read_requests`` makes a repeated id that row's error).
    """

    def __init__(self, output: str | os.PathLike[str], source: str | os.PathLike[str] | Source, spec: RowSpec | None = None, *,
                 format: str | None = None, resume: bool = False, journal: str | Path | None = None,
                 rows: int = DEFAULT_ROWS, embeddings: bool = False, prefix: str = "",
                 storage_options: dict[str, Any] | None = None) -> None:
        output = self.output = os.fspath(output)
        self.source = source if isinstance(source, Source) else open_source(source)
        self.spec = spec or RowSpec()
        self.format = format or format_of_name(output) or ""
        if self.format not in OUTPUT_FORMATS:
            raise SourceError(f"{output}: cannot tell the output format from the name (one of "
                              f"{', '.join(OUTPUT_FORMATS)})")
        self.embeddings = embeddings
        self.prefix = prefix
        self.rows = rows
        self.storage_options = dict(storage_options or {})
        self.fields = [(prefix + name, t) for name, t in result_fields(embeddings)]
        self.summary = WriteSummary()
        names = self.source.column_names()
        clash = [n for n, _ in self.fields if n in names]
        if clash:
            raise SourceError(f"the source already has a column {clash[0]!r}: give the result columns a "
                              "prefix (prefix='gen_')")
        # Arrow outputs need the source's types up front (JSONL: a pass over the file to unify them).
        self.schema = self.source.schema() if self.format != "jsonl" else None
        fs, path = url_to_fs(output, self.storage_options)
        src = self.source
        if src.fs is not None and fs.unstrip_protocol(path) == src.fs.unstrip_protocol(src.path):
            raise SourceError(f"{output} is the source itself: write the results to another file")
        self.journal = Journal(Path(journal) if journal else default_journal(output, fs, path),
                               fresh=not resume)
        self._check_journal(resume, fs, path)
        self.blocks = self.source.blocks(rows)
        self.sink: _Sink | None = None
        self.block: Block | None = None
        self.ids: list[str | None] = []
        self.waiting: dict[str, int] = {}  # custom_id -> offset in the block, for rows still without a result
        self.waiting_rows: set[int] = set()  # offsets of those rows (an invalid id waits for its row error)
        self._next_block()

    # ---- feeding ----------------------------------------------------------------------------------
    def add(self, result: str | dict[str, Any]) -> None:
        """One result line (OpenAI batch output shape, keyed by custom_id)."""
        line = json.loads(result) if isinstance(result, str) else result
        cid = line.get("custom_id")
        if not isinstance(cid, str):
            return  # a result for no row (an input line that was not one): nothing to join it to
        self.journal.put(cid, result_columns(line, self.embeddings))
        offset = self.waiting.pop(cid, None)
        if offset is not None:
            self.waiting_rows.discard(offset)
            self._flush_ready()

    def add_error(self, err: RowError) -> None:
        """A row that did not render: it is written with this error and no request."""
        self.journal.put_row_error(err.row, error_columns(err.code, str(err), self.embeddings))
        if self.block is not None and 0 <= err.row - self.block.start < len(self.block):
            offset = err.row - self.block.start
            self.waiting_rows.discard(offset)
            cid = self.ids[offset]
            if cid is not None and self.waiting.get(cid) == offset:
                del self.waiting[cid]
            self._flush_ready()

    def done(self, custom_id: str) -> bool:
        """Whether ``custom_id`` has a result already (a resume skips it)."""
        return self.journal.has(custom_id)

    @property
    def written(self) -> int:
        return self.summary.rows

    # ---- ending -----------------------------------------------------------------------------------
    def close(self) -> WriteSummary:
        """Write every row left (those still without a result: error ``no_result``); the output is then
        complete and the journal removed."""
        while self.block is not None:
            self._write_block()
            self._next_block()
        self._sink().close()
        self.journal.close()
        self.journal.remove()
        return self.summary

    def abort(self) -> None:
        """Stop without finishing: what is written stays readable where the format allows (Parquet
        gets its footer), and the journal stays for a resume."""
        if self.sink is not None:
            self.sink.close()
        self.journal.close()

    def __enter__(self) -> ResultsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # ---- the merge --------------------------------------------------------------------------------
    def _next_block(self) -> None:
        self.block = next(self.blocks, None)
        self.ids, self.waiting, self.waiting_rows = [], {}, set()
        if self.block is None:
            return
        b = self.block
        if self.spec.id_column:
            self.ids = [safe_row_id(v, self.spec.id_column) for v in b.column(self.spec.id_column)]
        else:
            self.ids = [str(b.start + i) for i in range(len(b))]
        answered = self.journal.present([i for i in self.ids if i is not None])
        errors = self.journal.row_errors(b.start, b.start + len(b))
        for offset, cid in enumerate(self.ids):
            if b.start + offset in errors or (cid is not None and cid in answered):
                continue
            self.waiting_rows.add(offset)
            if cid is not None:
                self.waiting.setdefault(cid, offset)
        self._flush_ready()

    def _flush_ready(self) -> None:
        while self.block is not None and not self.waiting_rows:
            self._write_block()
            self._next_block()

    def _write_block(self) -> None:
        b = self.block
        assert b is not None
        errors = self.journal.row_errors(b.start, b.start + len(b))
        found = self.journal.results([i for i in self.ids if i is not None])
        cols: list[dict[str, Any]] = []
        for offset, cid in enumerate(self.ids):
            c = errors.get(b.start + offset) or (found.get(cid) if cid is not None else None)
            if c is None:
                c = error_columns(NO_RESULT, f"row {b.start + offset}: no result (the run ended without one)",
                                  self.embeddings)
            cols.append(c)
            self._count(c)
        self._sink().write(b, cols)

    def _count(self, c: dict[str, Any]) -> None:
        s = self.summary
        s.rows += 1
        err = c.get("error")
        if err is None:
            s.completed += 1
        elif err.get("code") == NO_RESULT:
            s.no_result += 1
        else:
            s.failed += 1

    def _sink(self) -> _Sink:
        if self.sink is None:
            self.sink = _open_sink(self.output, self.format, self.schema, self.fields, self.prefix,
                                   self.storage_options)
        return self.sink

    def _check_journal(self, resume: bool, fs: Any, path: str) -> None:
        """A journal is for one source and id column; a resume without one reads the earlier output."""
        key = json.dumps([self.source.url, self.spec.id_column, self.prefix, self.embeddings])
        old = self.journal.get_meta("key")
        if old is not None and old != key:
            raise SourceError(f"the journal {self.journal.path} is of another run (source, id column or "
                              "columns differ): start without resume, or remove it")
        if resume and old is None and fs.exists(path):
            try:
                self._import_output()
            except SourceError:  # the journal is the one just made (it had no key): nothing to keep
                self.journal.close()
                self.journal.remove()
                raise
        self.journal.set_meta("key", key)

    def _import_output(self) -> None:
        """Rows of a finished earlier output (same source, in row order) count as done.

        Results are found by custom_id, which another source's output has too (row numbers, or the same
        ids): so each output row must carry the source's row as this output writes it (an output keeps
        every column of its source). That is the output's fingerprint of its input, checked row by row:
        it needs nothing stored beside the output, holds for outputs of any version, and lets a source
        move. The first row that differs refuses the resume (nothing is imported)."""
        try:
            earlier = open_source(self.output, format=self.format, storage_options=self.storage_options)
            mine = self.source.blocks(self.rows)
            n = 0
            done: list[tuple[str, dict[str, Any]]] = []
            for block in earlier.blocks(self.rows):
                expected = self._as_written(next(mine, None), len(block))
                for row, want in zip(block.rows(), expected, strict=True):
                    if row is not None:
                        self._check_row(n, row, want)
                        cols = columns_from_output_row(row, self.prefix, self.embeddings)
                        cid = safe_row_id(row.get(self.spec.id_column) if self.spec.id_column else n,
                                          self.spec.id_column)
                        if cid is not None and (cols.get("error") or {}).get("code") != NO_RESULT:
                            done.append((cid, cols))
                    n += 1
        except _OtherSource:
            raise
        except (SourceError, OSError, pa.ArrowException, ValueError) as e:
            raise SourceError(f"cannot resume from {self.output}: it is unreadable ({e}) and there is no "
                              "journal of the run; start without resume") from None
        for cid, cols in done:
            self.journal.put(cid, cols)

    def _as_written(self, block: Block | None, n: int) -> list[dict[str, Any] | None]:
        """The source columns of ``block``'s rows as this output reads back once written (None: no row)."""
        if block is None:
            return [None] * n
        if self.format == "jsonl":
            return ([_canonical(dict(r or {})) for r in block.cells()] + [None] * n)[:n]
        assert self.schema is not None
        batch = _source_batch(block, self.schema.remove_metadata())
        if self.format == "csv":
            buf = pa.BufferOutputStream()
            pa_csv.write_csv(pa.Table.from_batches([_csv_batch(batch)]), buf)
            rows: list[dict[str, Any] | None] = list(csv_rows(buf.getvalue().to_pybytes()))
        else:
            rows = list(batch.to_pylist())
        return ([None if r is None else _canonical(r) for r in rows] + [None] * n)[:n]

    def _check_row(self, n: int, row: dict[str, Any], want: dict[str, Any] | None) -> None:
        ours = {name for name, _ in self.fields}
        got = _canonical({k: v for k, v in row.items() if k not in ours})
        if got != want:
            what = "has no such row" if want is None else "holds another row there"
            raise _OtherSource(f"cannot resume: {self.output} is not the output of {self.source.url} (its row {n}: "
                               f"the source {what}); start without --resume, or resume with the source it was "
                               "made from")


class _OtherSource(SourceError):
    """The output a resume was to keep holds another source's rows."""


def _canonical(row: dict[str, Any]) -> Any:
    """A row's non-null values as comparable JSON (NaN equals NaN; bytes, times and decimals as written)."""
    return json.dumps({k: v for k, v in row.items() if v is not None}, sort_keys=True, ensure_ascii=False,
                      default=json_default)


def default_journal(output: str, fs: Any, path: str) -> Path:
    """Beside a local output; for a remote one, in the user's cache, named by the output's URL."""
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return Path(f"{path}.sluice-journal")
    digest = hashlib.sha256(output.encode()).hexdigest()[:24]
    return Path(platformdirs.user_cache_dir("sluice")) / "journals" / f"{digest}.sqlite"


# ---- sinks: one per output format -----------------------------------------------------------------
class _Sink:
    def __init__(self, url: str, fields: list[tuple[str, pa.DataType]], prefix: str,
                 storage_options: dict[str, Any]) -> None:
        self.fields = fields
        self.base = [n.removeprefix(prefix) for n, _ in fields]  # the names in the journal's columns
        self.file = fsspec.open(url, "wb", compression="infer", auto_mkdir=True, **storage_options).open()

    def write(self, block: Block, cols: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.file.close()


class _JsonlSink(_Sink):
    def write(self, block: Block, cols: list[dict[str, Any]]) -> None:
        lines = []
        for row, c in zip(block.cells(), cols, strict=True):
            out = dict(row or {})
            out.update((name, c.get(base)) for (name, _), base in zip(self.fields, self.base, strict=True))
            lines.append(json.dumps(out, ensure_ascii=False, default=json_default) + "\n")
        self.file.write("".join(lines).encode())
        self.file.flush()


class _ArrowSink(_Sink):
    def __init__(self, url: str, schema: pa.Schema, fields: list[tuple[str, pa.DataType]], prefix: str,
                 storage_options: dict[str, Any]) -> None:
        super().__init__(url, fields, prefix, storage_options)
        self.source_schema = schema.remove_metadata()  # pandas' metadata would not know the new columns
        self.schema = pa.schema(list(self.source_schema) + [pa.field(n, t) for n, t in fields])

    def batch(self, block: Block, cols: list[dict[str, Any]]) -> pa.RecordBatch:
        src = _source_batch(block, self.source_schema)
        arrays = [pa.array([c.get(base) for c in cols], type=t)
                  for (_, t), base in zip(self.fields, self.base, strict=True)]
        return pa.RecordBatch.from_arrays(list(src.columns) + arrays, schema=self.schema)


class _ParquetSink(_ArrowSink):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.writer = pq.ParquetWriter(self.file, self.schema)

    def write(self, block: Block, cols: list[dict[str, Any]]) -> None:
        self.writer.write_batch(self.batch(block, cols))  # one row group per block

    def close(self) -> None:
        self.writer.close()
        super().close()


class _CsvSink(_ArrowSink):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.writer = pa_csv.CSVWriter(self.file, _csv_schema(self.schema))

    def write(self, block: Block, cols: list[dict[str, Any]]) -> None:
        self.writer.write_batch(_csv_batch(self.batch(block, cols)))

    def close(self) -> None:
        self.writer.close()
        super().close()


def _source_batch(block: Block, schema: pa.Schema) -> pa.RecordBatch:
    """A block's source columns as an Arrow output writes them."""
    src = block.to_arrow(schema)
    return src if src.schema == schema else src.cast(schema)


def _csv_schema(schema: pa.Schema) -> pa.Schema:
    # CSV holds no nested values: structs and lists (usage, error, a messages column) as JSON text.
    return pa.schema([pa.field(f.name, pa.string()) if pa.types.is_nested(f.type) else f for f in schema])


def _csv_batch(b: pa.RecordBatch) -> pa.RecordBatch:
    arrays = [pa.array([None if v is None else json.dumps(v, ensure_ascii=False, default=json_default)
                        for v in col.to_pylist()], pa.string()) if pa.types.is_nested(col.type) else col
              for col in b.columns]
    return pa.RecordBatch.from_arrays(arrays, schema=_csv_schema(b.schema))


def _open_sink(url: str, fmt: str, schema: pa.Schema | None, fields: list[tuple[str, pa.DataType]], prefix: str,
               storage_options: dict[str, Any]) -> _Sink:
    if fmt == "jsonl":
        return _JsonlSink(url, fields, prefix, storage_options)
    assert schema is not None
    return (_ParquetSink if fmt == "parquet" else _CsvSink)(url, schema, fields, prefix, storage_options)
