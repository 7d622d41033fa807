"""Results out of Redis: once a batch's results stream holds more than ``SLUICE_RESULTS_SPILL`` results
(plus the newest ``KEEP``), the oldest move, in chunks, to files under
``SLUICE_FILES_DIR/results/<batch_id>/``. Redis keeps the counters, the job -> entry id map that makes
outcomes exactly-once, the list of chunk ends and the cursor (meta ``spilled``).

A chunk is written aside, fsynced and renamed before Redis notes it (scripts.SPILLED), and the stream
is trimmed only in that same script: a result is in the stream, in a noted file, or both, never in
neither. Readers (jobs/store.py) take ids up to ``spilled`` from the files and the rest from the
stream, each chunk only within its own id range, so a cursor crosses the boundary without a line
read twice or missed. Every process that reads or writes results must see the same directory.
"""

from __future__ import annotations

import bisect
import logging
import os
import secrets
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import redis
from sluice.jobs import keys
from sluice.jobs.scripts import Scripts, note_spilled
from sluice.jobs.settings import job_plane

log = logging.getLogger(__name__)

KEEP = 256  # newest results left in the stream: recent_results (throughput, ETA) reads them there
MAX_CHUNK = 10_000  # results per file: a reader skips at most this many lines to reach its cursor
LOCK_MS = 60_000
RETRY_MAX = 60.0  # seconds between tries at most while the disk refuses (full, read-only)


class SpilledResultsMissing(RuntimeError):
    """Results were moved to a file this process cannot read (another SLUICE_FILES_DIR)."""


@dataclass
class Spill:
    """One process's spilling. A batch over the threshold is owed a spill until it is under it again, so
    a batch that finished while the disk was full is still spilled once the disk has room (by
    ``spill_owed`` on a timer: no new result of it may ever come). After a failed write it waits,
    doubling up to RETRY_MAX, instead of refilling the disk with the same chunk at every write."""

    files_dir: Path
    at: int  # spill once the stream holds more than at + KEEP results
    owed: set[str] = field(default_factory=set)
    retry_at: float = 0.0  # time.monotonic() before which no spill is tried (after a failure)
    backoff: float = 0.0

    @classmethod
    def from_settings(cls) -> Spill | None:
        at = job_plane().results_spill
        return cls(files_dir(), at) if at else None

    def after_write(self, r: redis.Redis, scripts: Scripts, batch_ids: Iterable[str]) -> int:
        """Spill the batches of ``batch_ids`` (and those still owed) that hold too many results now; how
        many results moved. Raises OSError when the disk refuses (the results stay in Redis)."""
        self.owed.update(batch_ids)
        return self.spill_owed(r, scripts)

    def spill_owed(self, r: redis.Redis, scripts: Scripts) -> int:
        """One chunk for each owed batch still over the threshold, unless a failure asks to wait."""
        if not self.owed or time.monotonic() < self.retry_at:
            return 0
        ids = sorted(self.owed)
        pipe = r.pipeline(transaction=False)
        for bid in ids:
            pipe.xlen(keys.results(bid))
        moved = 0
        for bid, length in zip(ids, pipe.execute(), strict=True):
            if length <= self.at + KEEP:
                self.owed.discard(bid)  # spilled enough, or deleted meanwhile
                continue
            try:
                moved += spill(r, scripts, self.files_dir, bid, KEEP)
            except OSError:
                self.backoff = min(max(2 * self.backoff, 1.0), RETRY_MAX)
                self.retry_at = time.monotonic() + self.backoff
                raise
        self.backoff = 0.0
        return moved


def files_dir() -> Path:
    s = job_plane()
    return Path(s.files_dir or s.home / "files")


def batch_dir(root: Path, batch_id: str) -> Path:
    return root / "results" / keys.check_batch_id(batch_id)


def chunk_path(root: Path, batch_id: str, n: int, last: str) -> Path:
    return batch_dir(root, batch_id) / f"{n:06d}-{last}.jsonl"


def id_key(entry_id: str) -> tuple[int, int]:
    """A stream id as a comparable pair; "0" (the start) is (0, 0)."""
    ms, _, seq = entry_id.partition("-")
    return int(ms or 0), int(seq or 0)


def spill(r: redis.Redis, scripts: Scripts, root: Path, batch_id: str, keep: int = KEEP) -> int:
    """Move the batch's oldest results (all but ``keep``, at most MAX_CHUNK) to one chunk file; how
    many moved (0 when another process is spilling it)."""
    token = secrets.token_hex(8)
    lock = keys.spill_lock(batch_id)
    if not r.set(lock, token, nx=True, px=LOCK_MS):
        return 0
    try:
        return _spill_chunk(r, scripts, root, batch_id, keep, token)
    finally:
        if r.get(lock) == token:
            r.delete(lock)


def _spill_chunk(r: redis.Redis, scripts: Scripts, root: Path, bid: str, keep: int, token: str) -> int:
    meta, results, chunks = keys.meta(bid), keys.results(bid), keys.spill_chunks(bid)
    pipe = r.pipeline(transaction=False)
    pipe.hget(meta, "spilled")
    pipe.llen(chunks)
    pipe.xlen(results)
    spilled, n, length = pipe.execute()
    count = min(length - keep, MAX_CHUNK)
    if count <= 0:
        return 0
    entries = r.xrange(results, f"({spilled}" if spilled else "-", "+", count=count)
    if not entries:
        return 0
    last = entries[-1][0]
    path = chunk_path(root, bid, n, last)
    _write(path, entries, token)
    if note_spilled(scripts, bid, n, last, _next_id(last)):
        return len(entries)
    if r.lindex(chunks, n) != last:  # another process noted a different chunk n: ours is no one's
        path.unlink(missing_ok=True)
    return 0


def _write(path: Path, entries: list[tuple[str, dict[str, str]]], token: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{token}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            # One result per line: its stream id, a tab, its JSON (which escapes tabs and newlines).
            f.writelines(f"{eid}\t{fields['r']}\n" for eid, fields in entries)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not keep the half-written chunk
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself is durable before Redis forgets the results
    finally:
        os.close(fd)


def _next_id(entry_id: str) -> str:
    ms, seq = id_key(entry_id)
    return f"{ms}-{seq + 1}"


# ---- reading -------------------------------------------------------------------------------------
def read(r: redis.Redis, root: Path, batch_id: str, cursor: str, limit: int) -> list[tuple[str, str]]:
    """Spilled results after ``cursor``, oldest first, at most ``limit``: (stream id, result JSON)."""
    ends = r.lrange(keys.spill_chunks(batch_id), 0, -1)
    bounds = [id_key(e) for e in ends]
    after = id_key(cursor)
    out: list[tuple[str, str]] = []
    for i in range(bisect.bisect_right(bounds, after), len(ends)):
        lo = max(after, bounds[i - 1] if i else (0, 0))
        for eid, res in _lines(chunk_path(root, batch_id, i, ends[i])):
            if lo < id_key(eid) <= bounds[i]:
                out.append((eid, res))
                if len(out) >= limit:
                    return out
    return out


def find(r: redis.Redis, root: Path, batch_id: str, entry_id: str) -> str | None:
    """The result JSON of spilled entry ``entry_id``, or None."""
    ends = r.lrange(keys.spill_chunks(batch_id), 0, -1)
    i = bisect.bisect_left([id_key(e) for e in ends], id_key(entry_id))
    if i == len(ends):
        return None
    return next((res for eid, res in _lines(chunk_path(root, batch_id, i, ends[i])) if eid == entry_id), None)


def _lines(path: Path) -> Iterable[tuple[str, str]]:
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the with below, after the check
    except FileNotFoundError:
        raise SpilledResultsMissing(
            f"results were moved to {path}, which this process cannot read: set SLUICE_FILES_DIR to the "
            "directory the workers write them to") from None
    with f:
        for line in f:
            eid, _, res = line.rstrip("\n").partition("\t")
            yield eid, res


def remove(root: Path, batch_id: str) -> None:
    """The batch's spilled results, gone with the batch."""
    shutil.rmtree(batch_dir(root, batch_id), ignore_errors=True)
