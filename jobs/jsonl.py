"""Output files in JSON lines that a rerun resumes: what they already hold, and mending a torn end."""

from __future__ import annotations

import json
from pathlib import Path


def drop_torn_tail(path: Path) -> None:
    """A crash mid-write leaves a last line without its newline: cut it, so its request runs again."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


def values_in(path: Path, field: str) -> set[str]:
    """The ``field`` of every whole line of ``path`` (after cutting a torn last line), or none."""
    if not path.exists():
        return set()
    drop_torn_tail(path)
    found: set[str] = set()
    with path.open(encoding="utf-8", errors="replace") as f:
        for text in f:
            try:
                found.add(json.loads(text)[field])
            except (ValueError, KeyError, TypeError):
                continue
    return found
