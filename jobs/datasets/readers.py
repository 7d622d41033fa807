"""Dataset sources: a path or fsspec URL -> its rows in order, a record batch at a time.

Formats: JSONL, Parquet (a file or a directory of files), CSV, a ``datasets.save_to_disk`` directory
and a Hub dataset (``hf://datasets/owner/name``). Nothing reads the whole file: Parquet row groups,
CSV blocks, JSONL lines and the memory-mapped Arrow files of a saved dataset are read as iterated.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import date, datetime, time
from decimal import Decimal
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
from sluice.jobs.datasets.extras import missing, need

FORMATS = ("jsonl", "parquet", "csv", "saved", "hub")
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet",
             ".csv": "csv"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")
# fsspec protocols whose filesystem lives in another package.
_PROTOCOL_PACKAGE = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
                     "hf": "huggingface_hub"}
DEFAULT_ROWS = 4096  # rows per batch (and per output row group)
# A CSV piece: read and parsed one at a time, so this (not the file) bounds what a CSV costs in memory;
# a line longer than this is a piece of its own length.
CSV_BLOCK = 4 << 20
PARQUET_BUFFER = 1 << 20  # bytes read at a time from a Parquet column chunk
_BAD = "\0sluice:bad"  # a CSV batch's last column: why its row cannot be read (null: it can)


class SourceError(ValueError):
    """A source that cannot be read; ``str()`` is one line naming it."""


@dataclass
class Block:
    """Consecutive rows of a source. Arrow sources fill ``batch``; JSONL fills ``dicts``, with None for a
    line that is not a JSON object. ``bad`` says why a row cannot be read (by offset in the block: a JSONL
    line that is not an object, a CSV row with a cell that is not UTF-8, that cell null in ``batch``, or
    with more or fewer fields than the header, every cell null);
    ``rows()`` gives None for it, so the others' row numbers stay right, and ``cells()`` what it holds."""

    start: int  # the row number (from 0) of the first row
    batch: pa.RecordBatch | None = None
    dicts: list[dict[str, Any] | None] | None = None
    bad: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.batch.num_rows if self.batch is not None else len(self.dicts or [])

    def rows(self) -> list[dict[str, Any] | None]:
        """The rows to make requests of (None: a row that cannot be read)."""
        rows = self.cells()
        for i in self.bad:
            rows[i] = None
        return rows

    def cells(self) -> list[dict[str, Any] | None]:
        """The rows as an output keeps them: a bad CSV row's readable cells too (None: not a row)."""
        return list(self.batch.to_pylist()) if self.batch is not None else list(self.dicts or [])

    def column(self, name: str) -> list[Any]:
        """One column's values (None where a row lacks it)."""
        if self.batch is not None:
            return self.batch.column(name).to_pylist() if name in self.batch.schema.names else [None] * len(self)
        return [None if d is None else d.get(name) for d in self.dicts or []]

    def to_arrow(self, schema: pa.Schema) -> pa.RecordBatch:
        if self.batch is not None:
            return self.batch
        try:
            return pa.RecordBatch.from_pylist([d or {} for d in self.dicts or []], schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise SourceError(f"rows {self.start}-{self.start + len(self) - 1} do not fit the columns' types "
                              f"({e}); write JSONL output instead") from None


@dataclass
class Source:
    """An opened source: where it is, its format, and the filesystem to read it with."""

    url: str
    format: str
    fs: Any  # fsspec.AbstractFileSystem
    path: str
    split: str | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)
    data: Any = None  # an in-memory source (format "table": a pyarrow Table; "dataset": a datasets.Dataset)

    def blocks(self, rows: int = DEFAULT_ROWS) -> Iterator[Block]:
        """The rows in order, ``rows`` at a time (the last block may be shorter)."""
        start = 0
        try:
            if self.format == "jsonl":
                yield from _jsonl_blocks(self, rows)
                return
            for batch in _rechunk(self._batches(rows), rows):
                bad: dict[int, str] = {}
                if self.format == "csv":
                    batch, bad = _decoded(batch)
                yield Block(start, batch=batch, bad=bad)
                start += batch.num_rows
        except (OSError, pa.ArrowException) as e:
            raise SourceError(f"cannot read {self.url} (row {start} on): {_one_line(e)}") from None

    def schema(self) -> pa.Schema:
        """The columns and their types. JSONL has none of its own: a pass over the file unifies each
        block's (a column that holds text in one row and numbers in another cannot be written as Arrow)."""
        if self.format != "jsonl":
            return _arrow_schema(self)
        schemas = [pa.RecordBatch.from_pylist([d for d in b.dicts or [] if d is not None]).schema
                   for b in self.blocks()]
        try:
            return pa.unify_schemas(schemas or [pa.schema([])], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise SourceError(f"{self.url}: a column's values differ in type between rows ({_one_line(e)}); "
                              "write JSONL output, or make the column one type") from None

    def num_rows(self) -> int | None:
        """The row count where it is known without reading the rows (for a progress bar), else None."""
        if self.format == "table":
            return int(self.data.num_rows)
        if self.format == "dataset":
            return len(self.data)
        if self.format == "parquet":
            total = 0
            for f in _parquet_files(self):
                with self.fs.open(f, "rb") as fh:
                    total += pq.ParquetFile(fh).metadata.num_rows
            return total
        return None

    def column_names(self) -> list[str]:
        """Names without reading data where the format has a schema; JSONL: every key of any row."""
        if self.format != "jsonl":
            return list(_arrow_schema(self).names)
        names: dict[str, None] = {}
        for b in self.blocks():
            for d in b.dicts or []:
                names.update(dict.fromkeys(d or {}))
        return list(names)

    def _batches(self, rows: int) -> Iterator[pa.RecordBatch]:
        if self.format == "parquet":
            for f in _parquet_files(self):
                with self.fs.open(f, "rb") as fh:
                    # Not pre-buffered: pyarrow's default keeps every row group it read until the end
                    # (measured: RSS grew with the file); buffered reads stream even one huge row group.
                    pf = pq.ParquetFile(fh, pre_buffer=False, buffer_size=PARQUET_BUFFER)
                    _check_unique(pf.schema_arrow.names, self.url)
                    yield from pf.iter_batches(batch_size=rows)
        elif self.format == "csv":
            yield from _csv_source_batches(self, _csv_names(self))
        elif self.format == "table":
            _check_unique(self.data.schema.names, self.url)
            yield from self.data.to_batches(max_chunksize=rows)
        elif self.format in ("saved", "hub", "dataset"):
            ds = self.data if self.format == "dataset" else _hf_dataset(self)
            for table in ds.with_format("arrow").iter(batch_size=rows):
                yield from table.to_batches()
        else:
            raise SourceError(f"unknown format {self.format!r}")


def open_source(url: str | os.PathLike[str], *, format: str | None = None, split: str | None = None,
                storage_options: dict[str, Any] | None = None) -> Source:
    """Open ``url`` (a path or any fsspec URL); ``format`` is one of FORMATS, else told by the name.

    ``split`` picks one split of a saved ``DatasetDict`` or a Hub dataset (default: its only split, or
    ``train``). Raises SourceError (or MissingExtra) with a one-line message.
    """
    url = os.fspath(url)
    opts = dict(storage_options or {})
    if format is not None and format not in FORMATS:
        raise SourceError(f"unknown format {format!r} (one of {', '.join(FORMATS)})")
    if _hub_repo(url) is not None:
        return Source(url, format or "hub", None, url, split, opts)
    fs, path = url_to_fs(url, opts)
    try:
        if not fs.exists(path):
            raise SourceError(f"{url}: no such file or directory")
        return Source(url, format or _format_of(fs, path, url), fs, path, split, opts)
    except SourceError:
        raise
    except Exception as e:  # noqa: BLE001 - each filesystem raises its own kinds (network, auth): say which
        raise SourceError(f"cannot read {url}: {type(e).__name__}: {_one_line(e)}") from None


def open_data(data: Any) -> Source:
    """An in-memory source: a list of dicts, a pandas or polars DataFrame, a pyarrow Table or
    RecordBatch, or a ``datasets.Dataset`` (read as it is stored: memory-mapped, not copied)."""
    kind = f"{type(data).__module__.split('.')[0]}.{type(data).__name__}"
    if kind == "datasets.Dataset":
        return Source(f"<{kind}>", "dataset", None, "", data=data)
    if isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif isinstance(data, pa.Table):
        table = data
    elif kind == "pandas.DataFrame":
        table = pa.Table.from_pandas(data, preserve_index=False)
    elif kind == "polars.DataFrame":
        table = data.to_arrow()
    elif isinstance(data, list) and all(isinstance(r, dict) for r in data):
        try:
            table = pa.Table.from_pylist(data)
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise SourceError(f"the rows' values differ in type between rows ({_one_line(e)})") from None
    else:
        raise SourceError(f"cannot read a {kind} as rows: give a list of dicts, a pandas or polars DataFrame, "
                          "a pyarrow Table or a datasets.Dataset")
    return Source(f"<{kind}>", "table", None, "", data=table)


def url_to_fs(url: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """fsspec's filesystem for ``url``; a filesystem package that is missing names its extra."""
    try:
        return fsspec.core.url_to_fs(url, **storage_options)
    except ImportError:
        protocol = url.split("://", 1)[0] if "://" in url else "file"
        raise missing(_PROTOCOL_PACKAGE.get(protocol, protocol), f"{protocol}:// URLs") from None
    except ValueError as e:
        raise SourceError(f"{url}: {_one_line(e)}") from None


def format_of_name(path: str) -> str | None:
    """The format a file name says (``x.csv.gz`` is CSV), or None."""
    name = path.lower().rstrip("/")
    for c in _COMPRESSION:
        name = name.removesuffix(c)
    for suffix, fmt in _SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    return None


def json_default(v: Any) -> Any:
    """JSON for the Arrow values json cannot write (times, decimals, bytes)."""
    if isinstance(v, datetime | date | time):
        return v.isoformat()
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, bytes):
        return base64.b64encode(v).decode()
    return str(v)


def _format_of(fs: Any, path: str, url: str) -> str:
    if fs.isdir(path):
        if fs.exists(f"{path}/state.json") or fs.exists(f"{path}/dataset_dict.json"):
            return "saved"
        if any(format_of_name(f) == "parquet" for f in fs.find(path)):
            return "parquet"
        raise SourceError(f"{url}: a directory that is neither a saved dataset nor holds Parquet files")
    fmt = format_of_name(path)
    if fmt is None:
        raise SourceError(f"{url}: cannot tell the format from the name (give the format: "
                          f"{', '.join(FORMATS)})")
    return fmt


def _hub_repo(url: str) -> str | None:
    """``owner/name`` of ``hf://datasets/owner/name[@rev]`` (a whole repository, not one of its files)."""
    if not url.startswith("hf://datasets/"):
        return None
    parts = url.removeprefix("hf://datasets/").strip("/").split("/")
    return "/".join(parts) if len(parts) <= 2 and format_of_name(url) is None else None


def _parquet_files(src: Source) -> list[str]:
    if not src.fs.isdir(src.path):
        return [src.path]
    return sorted(f for f in src.fs.find(src.path) if format_of_name(f) == "parquet")


def _arrow_schema(src: Source) -> pa.Schema:
    if src.format == "parquet":
        schemas = []
        for f in _parquet_files(src):
            with src.fs.open(f, "rb") as fh:
                schemas.append(pq.ParquetFile(fh).schema_arrow)
            _check_unique(schemas[-1].names, f if f != src.path else src.url)
        return pa.unify_schemas(schemas)
    if src.format == "csv":
        return pa.schema([(n, pa.string()) for n in _csv_names(src)])
    if src.format == "table":
        _check_unique(src.data.schema.names, src.url)
        return src.data.schema
    try:
        return (src.data if src.format == "dataset" else _hf_dataset(src)).features.arrow_schema
    except AttributeError:  # a streamed Hub dataset may not know its features before its first rows
        first = next(src.blocks(1), None)
        return first.batch.schema if first is not None and first.batch is not None else pa.schema([])


def _check_unique(names: list[str], where: str) -> None:
    """Rows are dicts by column name: a second column of a name would silently replace the first."""
    counts = Counter(names)
    dup = [n for n in dict.fromkeys(names) if counts[n] > 1]
    if dup:
        raise SourceError(f"{where}: duplicate column names {', '.join(map(repr, dup))} (each column needs a name "
                          "of its own)")


def csv_rows(data: bytes) -> list[dict[str, Any] | None]:
    """CSV text's rows as a CSV source's ``Block.cells()`` reads them (every column text)."""
    names = _csv_header(io.BytesIO(data), "CSV text")
    return [r for batch in _csv_batches(io.BytesIO(data), names) for r in _decoded(batch)[0].to_pylist()]


def _csv_names(src: Source) -> list[str]:
    with fsspec.open(src.url, "rb", compression="infer", **src.storage_options) as fh:
        return _csv_header(fh, src.url)


def _csv_header(fh: Any, where: str) -> list[str]:
    """The header's names, from the file's first piece (only as much as its first lines)."""
    first = next(_csv_pieces(fh, 1 << 16), b"")
    header = first[:_first_row_end(first)]  # not the rows under it: a bad one fails alone, later
    try:
        names = list(pa_csv.open_csv(pa.BufferReader(header)).schema.names)
    except pa.ArrowInvalid as e:
        raise SourceError(f"cannot read {where}: {_one_line(e)}") from None
    _check_unique(names, where)
    return names


def _csv_source_batches(src: Source, names: list[str]) -> Iterator[pa.RecordBatch]:
    with fsspec.open(src.url, "rb", compression="infer", **src.storage_options) as fh:
        yield from _csv_batches(fh, names)


def _csv_batches(fh: Any, names: list[str]) -> Iterator[pa.RecordBatch]:
    """The rows, every column as bytes (``_decoded`` makes them text, row by row where one is not UTF-8).

    Not pyarrow's streaming reader: it fails the whole file on a line longer than its block ("straddling
    object"). Here each piece ends at a line's end, as that reader's blocks do (it too takes a newline for
    a row's end), and a longer line is a piece of its own length."""
    # A CSV has no types, and inferring them from the first rows would fail the run half-way where a
    # column that looked numeric there holds text later. An empty field is null (what a null is written
    # as), a quoted "" the empty text.
    convert = pa_csv.ConvertOptions(column_types={n: pa.binary() for n in names}, strings_can_be_null=True,
                                    quoted_strings_can_be_null=False)
    for n, piece in enumerate(_csv_pieces(fh, CSV_BLOCK)):
        # The first piece starts with the header; the others are rows under the same names.
        opts = pa_csv.ReadOptions(column_names=None if n == 0 else names, use_threads=False,
                                  block_size=len(piece) + 1)  # the piece in one block: no straddling
        try:
            table = pa_csv.read_csv(pa.BufferReader(piece), read_options=opts, convert_options=convert)
        except pa.ArrowInvalid:  # a row with too few or too many fields fails the piece: parse it row by row
            yield _csv_rows_one_by_one(piece, names, header=n == 0)
            continue
        for batch in table.to_batches():
            yield batch.append_column(_BAD, pa.nulls(batch.num_rows, pa.string()))


def _csv_rows_one_by_one(piece: bytes, names: list[str], header: bool) -> pa.RecordBatch:
    """A piece pyarrow refused, read with Python's csv module (the rare path): a row whose field count is
    not the header's is bad (its cells null, the reason in the ``_BAD`` column), the others read as
    pyarrow reads them (an empty field null; here a quoted "" is null too)."""
    csv.field_size_limit(max(csv.field_size_limit(), len(piece) + 1))  # a cell may be as long as the piece
    text = piece.decode("utf-8", "surrogateescape")  # undecodable bytes kept: ``_decoded`` names them by row
    records = [rec for rec in csv.reader(io.StringIO(text, newline="")) if rec]  # a blank line is no row
    cells: list[list[bytes | None]] = []
    bad: list[str | None] = []
    for rec in records[1:] if header else records:
        ok = len(rec) == len(names)
        cells.append([c.encode("utf-8", "surrogateescape") or None for c in rec] if ok else [None] * len(names))
        bad.append(None if ok else f"{len(rec)} fields where the header has {len(names)}")
    columns = [pa.array([row[i] for row in cells], pa.binary()) for i in range(len(names))]
    return pa.RecordBatch.from_arrays([*columns, pa.array(bad, pa.string())], names=[*names, _BAD])


def _csv_pieces(fh: Any, size: int) -> Iterator[bytes]:
    """The file in pieces of about ``size`` bytes, each ending at a row's end: a newline outside quotes
    (a quoted cell may hold newlines)."""
    held: list[bytes] = []  # a row's start, while its end is not read yet
    quotes = 0  # quote characters in ``held``
    while data := fh.read(size):
        cut = _row_end(data, quotes)
        if not cut:
            held.append(data)
            quotes += data.count(b'"')
            continue
        yield b"".join([*held, data[:cut]])
        held = [data[cut:]] if cut < len(data) else []
        quotes = data.count(b'"', cut)
    if any(held):
        yield b"".join([*held, b"\n"])  # a last line without its newline (a header alone: no rows)


def _row_end(data: bytes, quotes_before: int) -> int:
    """Just past the last newline of ``data`` outside quotes (0: none), ``quotes_before`` quote characters
    having come before it: a newline is outside quotes where an even number came before it (a doubled ""
    inside a quoted cell counts two)."""
    odd = (quotes_before + data.count(b'"')) % 2  # at the end of ``data``
    end = len(data)
    while (nl := data.rfind(b"\n", 0, end)) >= 0:
        odd ^= data.count(b'"', nl, end) % 2  # now: before ``nl``
        if not odd:
            return nl + 1
        end = nl
    return 0


def _first_row_end(data: bytes) -> int:
    """Just past the first newline of ``data`` outside quotes (its length: none)."""
    start = 0
    while (nl := data.find(b"\n", start)) >= 0:
        if data.count(b'"', 0, nl) % 2 == 0:
            return nl + 1
        start = nl + 1
    return len(data)


def _decoded(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, dict[int, str]]:
    """A CSV batch's byte columns as text; a row with a cell that is not UTF-8 is bad (by offset, naming
    the column and byte), so it fails alone; that cell is null, the row's others kept for the output."""
    bad = {i: why for i, why in enumerate(batch.column(_BAD).to_pylist()) if why is not None}
    batch = batch.drop_columns([_BAD])
    columns: list[pa.Array] = []
    for name, col in zip(batch.schema.names, batch.columns, strict=True):
        try:
            columns.append(col.cast(pa.string()))
            continue
        except pa.ArrowInvalid:  # not UTF-8 somewhere: find the rows, in Python (the rare path)
            pass
        values: list[str | None] = []
        for i, v in enumerate(col.to_pylist()):
            try:
                values.append(None if v is None else v.decode("utf-8"))
            except UnicodeDecodeError as e:
                bad.setdefault(i, f"not UTF-8 (column {name!r}, byte {e.start + 1})")
                values.append(None)
        columns.append(pa.array(values, pa.string()))
    return pa.RecordBatch.from_arrays(columns, names=batch.schema.names), bad


def _jsonl_blocks(src: Source, rows: int) -> Iterator[Block]:
    block = Block(0, dicts=[])
    with fsspec.open(src.url, "rb", compression="infer", **src.storage_options) as fh:
        for raw in fh:
            if not raw.strip():
                continue  # a blank line is no row
            dicts = block.dicts
            assert dicts is not None
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                block.bad[len(dicts)], obj = f"not UTF-8 (byte {e.start + 1})", None
            except json.JSONDecodeError as e:
                block.bad[len(dicts)], obj = f"not valid JSON: {e.msg} at column {e.colno}", None
            if obj is not None and not isinstance(obj, dict):
                block.bad[len(dicts)], obj = "a line must be a JSON object", None
            dicts.append(obj)
            if len(dicts) == rows:
                yield block
                block = Block(block.start + rows, dicts=[])
    if block.dicts:
        yield block


def _rechunk(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """Batches of exactly ``rows`` rows (the last may be shorter), whatever sizes the reader gives."""
    held: list[pa.RecordBatch] = []
    n = 0
    for b in batches:
        while b.num_rows:
            take = b.slice(0, rows - n)
            held.append(take)
            n += take.num_rows
            b = b.slice(take.num_rows)
            if n == rows:
                yield pa.concat_batches(held) if len(held) > 1 else held[0]
                held, n = [], 0
    if n:
        yield pa.concat_batches(held) if len(held) > 1 else held[0]


def _hf_dataset(src: Source) -> Any:
    """The ``datasets`` Dataset (saved: memory-mapped, not loaded) or IterableDataset (Hub: streamed)."""
    ds_lib = need("datasets", "saved and Hub datasets")
    try:
        if src.format == "saved":
            ds = ds_lib.load_from_disk(src.url, storage_options=src.storage_options or None)
        else:
            repo = _hub_repo(src.url) or src.url.removeprefix("hf://datasets/")
            name, _, rev = repo.partition("@")
            ds = ds_lib.load_dataset(name, split=src.split or "train", streaming=True, revision=rev or None,
                                     storage_options=src.storage_options or None)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds (hub, network, format): say which
        hint = " (is the Hub reachable from here?)" if src.format == "hub" else ""
        raise SourceError(f"cannot read {src.url}: {type(e).__name__}: {_one_line(e)}{hint}") from None
    if isinstance(ds, ds_lib.DatasetDict):
        splits = list(ds)
        split = src.split or (splits[0] if len(splits) == 1 else None)
        if split not in ds:
            raise SourceError(f"{src.url} has splits {', '.join(splits)}: choose one (split=)")
        ds = ds[split]
    return ds


def _one_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300]
