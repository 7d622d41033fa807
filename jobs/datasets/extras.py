"""Optional dependencies: a missing one is a one-line error naming the extra that brings it."""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> (extra, what to install); the extra is the documented way, the package the fallback.
_EXTRAS = {
    "pyarrow": "datasets", "fsspec": "datasets", "datasets": "datasets", "jinja2": "datasets",
    "s3fs": "s3",
}


class MissingExtra(ImportError):
    """An optional dependency is not installed; ``str()`` is one line saying what to install."""


def missing(module: str, what: str = "") -> MissingExtra:
    extra = _EXTRAS.get(module)
    how = f"pip install 'sluice-llm[{extra}]'" if extra else f"pip install {module}"
    return MissingExtra(f"{what or 'this'} needs {module}, which is not installed: {how}")


def need(module: str, what: str = "") -> ModuleType:
    """Import ``module`` or raise MissingExtra naming its extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise missing(module, what) from None
