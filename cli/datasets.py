"""`sluice generate`, `submit` and `results` on datasets: a Parquet, CSV or JSONL file, a saved or Hub
dataset, at a path or any fsspec URL, in; the same rows with result columns out (jobs/datasets).

A command runs on a dataset when a row flag (--prompt-column, --template, ...) or --output-format is
given, or its input or output is not a local JSONL file (a URL, a directory, .parquet, .csv); a local
JSONL file in and out, without those flags, runs as it always has, line by line. Object storage
takes its credentials and endpoint from the store's own environment (AWS_* for s3://).
"""

from __future__ import annotations

import functools
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import click
from sluice.cli.common import EXIT_USAGE, UserError, one_line

if TYPE_CHECKING:
    from sluice.jobs.datasets import ResultsWriter, RowSpec, Source, WriteSummary

# Told by the name without pyarrow (a JSONL run must not need the datasets extra).
_DATASET_SUFFIXES = (".parquet", ".pq", ".csv")
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")
OUTPUT_FORMATS = ("parquet", "jsonl", "csv")
_FIELD = re.compile(r"(?<![\w'-])(prompt_column|messages_column|template_file|template|system|id_column|image_column)(?![\w'-])")


class UsageLine(click.ClickException):
    """A usage error (exit 2) in one line: flags that cannot go together, a column the source lacks."""

    exit_code = EXIT_USAGE


class InputArg(click.ParamType):
    """A local path (``exists``: checked as click.Path checks it), ``-`` for stdin, or any fsspec URL."""

    name = "input"

    def __init__(self, exists: bool) -> None:
        self.path = click.Path(exists=exists, allow_dash=True)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        value = os.fspath(value)
        if "://" in value:
            return value
        try:
            return str(self.path.convert(value, param, ctx))
        except click.BadParameter as e:  # one line, not click's usage text
            raise UsageLine(e.format_message()) from None


@dataclass
class RowFlags:
    """The row flags of a command (how a row becomes a request) and --output-format."""

    prompt_column: str | None = None
    messages_column: str | None = None
    template: str | None = None
    template_file: str | None = None
    system: str | None = None
    id_column: str | None = None
    model_column: str | None = None
    image_column: str | None = None
    output_format: str | None = None

    def row_given(self) -> bool:
        return any(getattr(self, f.name) is not None for f in fields(self) if f.name != "output_format")

    def given(self) -> bool:
        return self.row_given() or self.output_format is not None

    def spec(self) -> RowSpec:
        from sluice.jobs.datasets import RowSpec, SpecError

        try:
            return RowSpec(prompt_column=self.prompt_column, messages_column=self.messages_column,
                           template=self.template, template_file=self.template_file, system=self.system,
                           id_column=self.id_column, model_column=self.model_column, image_column=self.image_column)
        except SpecError as e:
            raise UsageLine(_flag_names(str(e))) from None


_ROW_OPTIONS = [
    click.option("--prompt-column", metavar="COL", default=None, help="Dataset input: the column holding each "
                 "row's prompt (the user's message)."),
    click.option("--messages-column", metavar="COL", default=None, help="Dataset input: the column holding each "
                 "row's chat messages (a list, or its JSON text)."),
    click.option("--template", default=None, help="Dataset input: the prompt made from the row's columns, e.g. "
                 "'Summarise: {text}'."),
    click.option("--template-file", metavar="PATH", default=None, help="Dataset input: a Jinja template (a path "
                 "or URL) over the row's columns."),
    click.option("--system", default=None, help="Dataset input: a system message before each row's prompt."),
    click.option("--id-column", metavar="COL", default=None, help="Dataset input: the column naming each row's "
                 "request (text or integer) [default: the row number, from 0]."),
    click.option("--model-column", metavar="COL", default=None, help="Dataset input: the column naming each "
                 "row's model; 'BASE:ADAPTER' (or a bare adapter name) runs that --lora adapter."),
    click.option("--image-column", metavar="COL", default=None, help="Dataset input: the column holding each "
                 "row's image (bytes, a path or a URL), sent with its prompt to a vision-language model; paths "
                 "and URLs are read only under the worker's --image-url-prefix."),
]
_OUTPUT_FORMAT = click.option("--output-format", type=click.Choice(OUTPUT_FORMATS), default=None,
                              help="Write the source's rows with result columns added, in this format "
                              "[default: told by OUTPUT's name].")


def with_row_options(output_format: bool = True) -> Callable[[Any], Any]:
    """The row flags (and --output-format), handed to the command as one ``rows: RowFlags``."""
    names = [f.name for f in fields(RowFlags) if output_format or f.name != "output_format"]

    def decorate(f: Any) -> Any:
        @functools.wraps(f)
        def wrapper(*args: Any, **kw: Any) -> Any:
            return f(*args, rows=RowFlags(**{n: kw.pop(n) for n in names}), **kw)

        for option in reversed(_ROW_OPTIONS + ([_OUTPUT_FORMAT] if output_format else [])):
            wrapper = option(wrapper)
        return wrapper

    return decorate


def is_dataset_name(name: str) -> bool:
    """A URL, a directory, or a file named as Parquet or CSV (not ``-``, not a local JSONL file)."""
    if name == "-":
        return False
    if "://" in name or os.path.isdir(name):
        return True
    low = name.lower()
    for c in _COMPRESSION:
        low = low.removesuffix(c)
    return low.endswith(_DATASET_SUFFIXES)


def wants_dataset(rows: RowFlags, *names: str | None) -> bool:
    return rows.given() or any(n is not None and is_dataset_name(os.fspath(n)) for n in names)


@contextmanager
def dataset_errors() -> Iterator[None]:
    """The datasets library's errors as one line: a missing extra, an unreadable source (exit 1), a
    spec that does not fit the source (a usage error, exit 2)."""
    try:
        from sluice.jobs.datasets import SourceError, SpecError
    except ImportError as e:  # the datasets extra is not installed
        raise UserError(str(e).replace("this needs", "dataset inputs and outputs need", 1)) from None
    try:
        yield
    except SpecError as e:
        raise UsageLine(_flag_names(str(e))) from None
    except ImportError as e:  # a filesystem's package (s3fs) or datasets/jinja2
        raise UserError(one_line(e)) from None
    except (SourceError, OSError) as e:
        raise UserError(one_line(e)) from None


def open_input(url: str) -> Source:
    from sluice.jobs.datasets import open_source

    return open_source(url)


def check_spec(source: Source, spec: RowSpec) -> None:
    """A spec that names a column the source lacks fails here, before a model loads or a batch is made."""
    from sluice.jobs.datasets.rows import RowRenderer

    RowRenderer(spec, None if source.format == "jsonl" else source.column_names())


def open_writer(output: str, source: Source, spec: RowSpec, rows: RowFlags, resume: bool = False,
                embeddings: bool = False) -> ResultsWriter:
    from sluice.jobs.datasets import ResultsWriter

    return ResultsWriter(output, source, spec, format=rows.output_format, resume=resume, embeddings=embeddings)


def run_writer(writer: ResultsWriter, run: Callable[[], WriteSummary], interrupted: str) -> WriteSummary:
    """``run()`` (which closes the writer); anything that stops it leaves the written rows readable and
    the journal for a resume; Ctrl-C exits 130 saying how to go on."""
    try:
        return run()
    except KeyboardInterrupt:
        writer.abort()
        click.echo(interrupted, err=True)
        raise SystemExit(130) from None
    except BaseException:
        writer.abort()
        raise


def summary_text(s: WriteSummary, seconds: float, output: str) -> str:
    left = f", {s.no_result} without a result" if s.no_result else ""
    return (f"{s.rows} rows: {s.completed} completed, {s.failed} failed{left} (why: the error column) in "
            f"{seconds:.1f}s -> {output}")


def generate_dataset(input_url: str, output: str, rows: RowFlags, *, resume: bool, progress: bool,
                     make_engine: Callable[[], Any], defaults: Any, plan: bool = True,
                     embed: bool = False) -> WriteSummary:
    """`sluice generate` on a dataset: rows through the engine in this process, joined to OUTPUT
    (``embed``: an embedding model's, each row's text embedded into an embedding column)."""
    t0 = time.time()
    with dataset_errors():
        from sluice.worker.generate_rows import generate_rows

        spec = replace(rows.spec(), embed=embed)
        source = open_input(input_url)
        check_spec(source, spec)
        writer = open_writer(output, source, spec, rows, resume, embeddings=embed)
        if resume:
            click.echo(f"resuming: {writer.journal.count()} rows already have a result", err=True)
        s = run_writer(writer, lambda: generate_rows(source, spec, writer, make_engine, defaults=defaults,
                                                     resume=resume, progress=progress, plan=plan),
                       f"interrupted: the rows written so far are kept; --resume goes on from them -> {output}")
    click.echo(summary_text(s, time.time() - t0, output), err=True)
    return s


def _flag_names(message: str) -> str:
    """RowSpec speaks of its fields (prompt_column); the CLI user gave flags (--prompt-column)."""
    return _FIELD.sub(lambda m: "--" + m[0].replace("_", "-"), message)
