"""Sluice from Python: a dataset in, the same dataset with result columns out.

``sluice.generate(data, ...)`` runs the engine in this process (like ``sluice generate``);
``sluice.submit(data, ...)`` queues the rows on the job server and returns a ``sluice.Batch`` to
watch, wait for and read back. ``data`` is a list of dicts, a pandas or polars DataFrame, a pyarrow
Table, a ``datasets.Dataset``, or the path / fsspec URL of a JSONL, Parquet or CSV file or a saved
dataset. Results keep every source column and add ``completion``, ``finish_reason``, ``usage`` and
``error`` (a row that could not be made a request has only ``error``, naming its row).

    import pandas as pd, sluice
    df = pd.DataFrame({"text": ["The cat sat on the mat.", "Rain is wet."]})
    out = sluice.generate(df, template="Summarise in three words: {text}", max_tokens=16)
    out[["text", "completion"]]

Needs the ``datasets`` extra; ``generate`` also the ``worker`` extra (the engine).
"""

from __future__ import annotations

from pathlib import Path as _Path

# In an install, sluice.engine, sluice.jobs, ... lie in this folder (pyproject.toml's package-dir mapping).
# A source checkout that is not installed (the GPU machine's copy, a script run from the checkout with
# another Python) has them beside it instead: look there too.
_checkout = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).parent / "engine").exists() and (_checkout / "engine" / "__init__.py").exists():
    __path__.append(str(_checkout))

from sluice.batch import Batch, submit  # noqa: E402 - after the path above
from sluice.generate import generate  # noqa: E402

__all__ = ["Batch", "generate", "submit"]
