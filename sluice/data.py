"""What the Python API shares: the row spec from keyword arguments, the source from ``data``, and the
joined results handed back in the kind of ``data`` the caller gave."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sluice.jobs.datasets import ResultsWriter, RowSpec, Source, open_data, open_source
from sluice.jobs.schemas import SamplingParams

# Accepted as ``data``: rows in memory, or where a dataset is.
Data = Any  # list[dict] | pandas.DataFrame | polars.DataFrame | pyarrow.Table | datasets.Dataset | str | os.PathLike


def source_of(data: Data, storage_options: dict[str, Any] | None = None) -> Source:
    if isinstance(data, str | os.PathLike):
        return open_source(data, storage_options=storage_options)
    return open_data(data)


def row_spec(prompt_column: str | None, messages_column: str | None, template: str | None,
             template_file: str | None, system: str | None, id_column: str | None, chat: bool,
             model_column: str | None = None, image_column: str | None = None) -> RowSpec:
    return RowSpec(prompt_column=prompt_column, messages_column=messages_column, template=template,
                   template_file=template_file, system=system, id_column=id_column, chat=chat,
                   model_column=model_column, image_column=image_column)


def sampling_defaults(sampling: dict[str, Any]) -> SamplingParams | None:
    """Keyword sampling settings (``max_tokens=16, temperature=0.7``) as every row's defaults; a column
    of the same name still sets its own row's. Raises ValueError naming a bad one."""
    return SamplingParams(**sampling) if sampling else None


@contextmanager
def joined(source: Source, spec: RowSpec, output: str | None, resume: bool = False,
           **writer: Any) -> Iterator[tuple[ResultsWriter, Callable[[], Any]]]:
    """A ResultsWriter to ``output`` (or a temporary Parquet file) and a function that reads what it
    wrote back as a pyarrow Table, once it is closed."""
    with tempfile.TemporaryDirectory(prefix="sluice-api-") as tmp:
        url = output or str(Path(tmp) / "results.parquet")
        w = ResultsWriter(url, source, spec, resume=resume, **writer)

        def table() -> Any:
            import pyarrow.parquet as pq

            return pq.read_table(url)

        yield w, table


def like(table: Any, data: Data) -> Any:
    """``table`` as the kind of ``data``: a DataFrame for a DataFrame, a Dataset for a Dataset, rows for
    rows; a pyarrow Table otherwise."""
    kind = f"{type(data).__module__.split('.')[0]}.{type(data).__name__}"
    if kind == "pandas.DataFrame":
        return table.to_pandas()
    if kind == "polars.DataFrame":
        import polars

        return polars.from_arrow(table)
    if kind == "datasets.Dataset":
        import datasets

        return datasets.Dataset(table)
    if isinstance(data, list):
        return table.to_pylist()
    return table
