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

import os as _os
import sys as _sys
from pathlib import Path as _Path
from typing import TYPE_CHECKING, Any

_here = _Path(__file__).resolve().parent
_checkout = _here.parent
if not (_here / "engine").exists() and (_checkout / "engine" / "__init__.py").exists():
    # In an install, sluice.engine, sluice.jobs, ... lie in this folder (pyproject.toml's package-dir
    # mapping). A source checkout has them beside it instead: an editable install maps them, and one that
    # is not installed (the GPU machine's copy, a script run with another Python) finds them here.
    __path__.append(str(_checkout))
    # A process started in the checkout has it first on sys.path, where engine/, kernels/, ... would import
    # as top-level packages: transformers' `import kernels` (Hugging Face's package) would get ours. Last,
    # it hides nothing and still serves `bench.*` to scripts.
    _rest = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != str(_checkout)]
    if len(_rest) < len(_sys.path):
        _sys.path[:] = [*_rest, str(_checkout)]

if TYPE_CHECKING:
    from sluice.batch import Batch, submit
    from sluice.generate import generate

__all__ = ["Batch", "generate", "submit"]


def __getattr__(name: str) -> Any:
    """The Python API on first use: ``import sluice.cli`` (or any sluice.*) runs this file, and need not
    import the dataset readers (the ``datasets`` extra) that the API needs."""
    if name in ("Batch", "submit"):
        from sluice import batch

        return getattr(batch, name)
    if name == "generate":
        from sluice.generate import generate

        return generate
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")
