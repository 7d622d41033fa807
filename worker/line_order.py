"""Put a finished JSONL results file back in input order.

``sluice generate`` writes each result the moment it finishes (an interrupted run keeps what finished and
``--resume`` picks up from it), so lines land in finish order, which prefix planning shuffles further.
Once the run is complete the file is rewritten in the input's order: an index of (rank, offset, length)
per line, then one pass copying the lines in rank order into a new file that replaces the old one, so
memory holds the index, never the results.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def sort_by_input(path: Path, rank: dict[str, int]) -> None:
    """Rewrite ``path`` with its lines ordered by ``rank[custom_id]``; lines without a ranked custom_id
    keep their relative order after the ranked ones. Only a regular file (stdout is left as written)."""
    if not path.is_file():
        return
    index: list[tuple[int, int, int]] = []  # (rank, offset, length)
    unranked = len(rank) + 1
    offset = 0
    with path.open("rb") as f:
        for line in f:
            index.append((rank.get(custom_id_of(line) or "", unranked), offset, len(line)))
            offset += len(line)
    if all(a[0] <= b[0] for a, b in zip(index, index[1:], strict=False)):
        return  # already in order
    index.sort(key=lambda x: x[0])  # stable: unranked lines keep their order
    tmp = path.with_name(f".{path.name}.sorting")
    with path.open("rb") as src, tmp.open("wb") as dst:
        for _, at, n in index:
            src.seek(at)
            line = src.read(n)
            dst.write(line if line.endswith(b"\n") else line + b"\n")  # a last line cut short stays a line
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, path)


def custom_id_of(line: str | bytes) -> str | None:
    """A JSONL line's custom_id, or None (not JSON, not an object, none or not a string)."""
    try:
        v = json.loads(line).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return v if isinstance(v, str) and v else None
