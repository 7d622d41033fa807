"""The writer's journal: every result and row error so far, on disk (SQLite), keyed for the merge.

Results land in any order; the ones whose row group is not due yet wait here, not in memory. Each
write is committed at once, so after a kill -9 the journal holds every result that was reported, and a
resumed run skips those rows and rewrites the output from it.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (custom_id TEXT PRIMARY KEY, cols TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS row_errors (row INTEGER PRIMARY KEY, cols TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
_CHUNK = 500  # ids per IN (...) query, under SQLite's variable limit


class Journal:
    """Result columns by custom_id, and row errors by row number. One thread uses it at a time."""

    def __init__(self, path: Path, *, fresh: bool) -> None:
        self.path = path
        if fresh:
            self.remove()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        # WAL without fsync per commit: a committed write survives the process being killed (it is in
        # the OS's cache), which is the failure resume is for; a power cut may lose the last results.
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    def put(self, custom_id: str, cols: dict[str, Any]) -> None:
        self.db.execute("INSERT OR REPLACE INTO results VALUES (?, ?)", (custom_id, json.dumps(cols)))

    def put_row_error(self, row: int, cols: dict[str, Any]) -> None:
        self.db.execute("INSERT OR REPLACE INTO row_errors VALUES (?, ?)", (row, json.dumps(cols)))

    def has(self, custom_id: str) -> bool:
        return self.db.execute("SELECT 1 FROM results WHERE custom_id = ?", (custom_id,)).fetchone() is not None

    def results(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        for i in range(0, len(ids), _CHUNK):
            part = ids[i:i + _CHUNK]
            q = f"SELECT custom_id, cols FROM results WHERE custom_id IN ({','.join('?' * len(part))})"
            found.update((k, json.loads(v)) for k, v in self.db.execute(q, part))
        return found

    def present(self, ids: list[str]) -> set[str]:
        found: set[str] = set()
        for i in range(0, len(ids), _CHUNK):
            part = ids[i:i + _CHUNK]
            q = f"SELECT custom_id FROM results WHERE custom_id IN ({','.join('?' * len(part))})"
            found.update(k for (k,) in self.db.execute(q, part))
        return found

    def row_errors(self, start: int, end: int) -> dict[int, dict[str, Any]]:
        q = "SELECT row, cols FROM row_errors WHERE row >= ? AND row < ?"
        return {r: json.loads(v) for r, v in self.db.execute(q, (start, end))}

    def count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM results").fetchone()[0])

    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def close(self) -> None:
        self.db.close()

    def remove(self) -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
