"""Files of the OpenAI Files API, kept on disk under ``Settings.files_dir`` (default ``SLUICE_HOME/files``).

Why disk and not Redis: an input file can be 200 MB and is read once, when its batch is created (the
jobs then live in Redis streams); keeping it out of Redis keeps the job server's memory for jobs.
Several API processes share files only through a shared ``files_dir``.

Layout: ``<id>.jsonl`` holds an uploaded file's bytes and ``<id>.json`` its File object (plus what the
upload check found: request count, model, endpoint). A batch's output and error files are not stored
when it runs: their ids (``file-output-<batch id>``, ``file-errors-<batch id>``) name the batch, and the
first read after the batch is final renders them from its results into ``batches/`` once.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import redis
from sluice.jobs.housekeeping import RESULTS_TTL
from sluice.jobs.openai_output import line_error_to_output_line, result_to_output_line
from sluice.jobs.schemas import Batch
from sluice.jobs.store import get_batch, get_line_errors, read_results

_UPLOAD_ID = re.compile(r"^file-[0-9a-f]{24}$")
OUTPUT_PREFIX, ERRORS_PREFIX = "file-output-", "file-errors-"
COPY_CHUNK = 1 << 20
UPLOAD_TTL = 30 * 24 * 3600  # seconds an upload lives without expires_after (as OpenAI's batch files)


class TooLarge(Exception):
    pass


class DiskFull(Exception):
    """The files directory refused a write (full, read-only, over quota); nothing of it was kept."""


@dataclass
class StoredFile:
    meta: dict[str, Any]
    path: Path

    def public(self) -> dict[str, Any]:
        """The OpenAI File object."""
        return {k: v for k, v in self.meta.items() if k != "sluice"}

    @property
    def info(self) -> dict[str, Any]:
        return self.meta.get("sluice") or {}


def output_file_id(batch: Batch) -> str | None:
    """The id of a batch's output file: once it is final with every outcome in, if any completed."""
    return OUTPUT_PREFIX + batch.id if _settled(batch) and batch.counts.completed else None


def error_file_id(batch: Batch) -> str | None:
    c = batch.counts
    return ERRORS_PREFIX + batch.id if _settled(batch) and c.done - c.completed + c.invalid else None


def _settled(batch: Batch) -> bool:
    return batch.is_final and batch.counts.done >= batch.counts.total


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    # ---- uploads ---------------------------------------------------------------------------------
    def receive(self, src: IO[bytes], max_bytes: int) -> Path:
        """Copy an upload to a temporary file, refusing it past ``max_bytes``."""
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".upload-{uuid.uuid4().hex}"
        size = 0
        try:
            with tmp.open("wb") as out:
                while chunk := src.read(COPY_CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(f"the file is larger than {max_bytes} bytes")
                    out.write(chunk)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise DiskFull(f"storing the file failed: {e.strerror or e}") from None
            raise
        return tmp

    def add(self, tmp: Path, filename: str, purpose: str, info: dict[str, Any], ttl: float = UPLOAD_TTL) -> StoredFile:
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        now_ns = time.time_ns()
        now = now_ns // 10**9
        # created_at is whole seconds (OpenAI's); the nanoseconds order uploads made within one second.
        meta = {"id": file_id, "object": "file", "bytes": tmp.stat().st_size, "created_at": now,
                "filename": filename, "purpose": purpose, "status": "processed", "expires_at": int(now + ttl),
                "status_details": None, "sluice": {**info, "uploaded_ns": now_ns}}
        path = self.root / f"{file_id}.jsonl"
        tmp.replace(path)
        try:
            _write_atomic(self.root / f"{file_id}.json", json.dumps(meta).encode())
        except OSError as e:
            path.unlink(missing_ok=True)
            raise DiskFull(f"storing the file failed: {e.strerror or e}") from None
        return StoredFile(meta, path)

    def get_upload(self, file_id: str) -> StoredFile | None:
        """An uploaded file; None once it expired (its bytes are deleted then)."""
        if not _UPLOAD_ID.match(file_id):
            return None
        try:
            meta = json.loads((self.root / f"{file_id}.json").read_text())
        except (OSError, ValueError):
            return None
        if _expired(meta):
            self.delete_upload(file_id, meta)
            return None
        return StoredFile(meta, self.root / f"{file_id}.jsonl")

    def delete_expired(self) -> int:
        """Housekeeping: delete every upload and rendered batch file past its expires_at; returns how many."""
        n = 0
        if not self.root.is_dir():
            return 0
        for p in self.root.glob("file-*.json"):
            n += self.get_upload(p.stem) is None and not p.exists()
        for p in (self.root / "batches").glob("*.expires"):
            try:
                expired = float(p.read_text()) <= time.time()
            except (OSError, ValueError):
                continue
            if expired:
                p.with_suffix(".jsonl").unlink(missing_ok=True)
                p.unlink(missing_ok=True)
                n += 1
        return n

    def list_uploads(self) -> list[StoredFile]:
        """Newest first."""
        if not self.root.is_dir():
            return []
        files = [self.get_upload(p.stem) for p in self.root.glob("file-*.json")]
        return sorted((f for f in files if f is not None), key=_newest_first)

    def delete_upload(self, file_id: str, meta: dict[str, Any] | None = None) -> bool:
        if meta is None and self.get_upload(file_id) is None:
            return False
        (self.root / f"{file_id}.json").unlink(missing_ok=True)
        (self.root / f"{file_id}.jsonl").unlink(missing_ok=True)
        return True

    # ---- a batch's output and error files --------------------------------------------------------
    def get(self, r: redis.Redis, file_id: str) -> StoredFile | None:
        """An uploaded file, or a batch's output or error file (rendered on first read)."""
        if file_id.startswith((OUTPUT_PREFIX, ERRORS_PREFIX)):
            return self._batch_file(r, file_id)
        return self.get_upload(file_id)

    def _batch_file(self, r: redis.Redis, file_id: str) -> StoredFile | None:
        errors = file_id.startswith(ERRORS_PREFIX)
        bid = file_id.removeprefix(ERRORS_PREFIX if errors else OUTPUT_PREFIX)
        batch = get_batch(r, bid, max_errors=0) if bid else None
        if batch is None or file_id != (error_file_id(batch) if errors else output_file_id(batch)):
            return None
        path = self._batch_path(file_id)
        ended = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at or batch.created_at
        created = int(ended)
        expires_at = int(created + (batch.output_expires_after or RESULTS_TTL))
        if expires_at <= time.time():
            path.unlink(missing_ok=True)
            return None
        # Rendered before the batch last ended: some of its jobs ran again since (jobs/reopen.py).
        if not path.exists() or path.stat().st_mtime < ended:
            self._render(r, batch, expires_at)
        kind = "errors" if errors else "output"
        meta = {"id": file_id, "object": "file", "bytes": path.stat().st_size, "created_at": created,
                "filename": f"{bid}_{kind}.jsonl", "purpose": "batch_output", "status": "processed",
                "expires_at": expires_at, "status_details": None}
        return StoredFile(meta, path)

    def _batch_path(self, file_id: str) -> Path:
        # Hashed: a batch id may hold characters a file name should not.
        return self.root / "batches" / f"{hashlib.sha256(file_id.encode()).hexdigest()[:32]}.jsonl"

    def _render(self, r: redis.Redis, batch: Batch, expires_at: int) -> None:
        """Both files of a final batch in one pass over its results (written aside, then renamed)."""
        out_path, err_path = self._batch_path(OUTPUT_PREFIX + batch.id), self._batch_path(ERRORS_PREFIX + batch.id)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex
        out_tmp, err_tmp = out_path.with_suffix(f".{tag}.tmp"), err_path.with_suffix(f".{tag}.tmp")
        with out_tmp.open("w", encoding="utf-8") as out, err_tmp.open("w", encoding="utf-8") as err:
            for info in get_line_errors(r, batch.id):
                err.write(json.dumps(line_error_to_output_line(info), ensure_ascii=False) + "\n")
            for res in _all_results(r, batch.id):
                line = json.dumps(result_to_output_line(None, res), ensure_ascii=False) + "\n"
                (out if res.status == "completed" else err).write(line)
        os.replace(out_tmp, out_path)
        os.replace(err_tmp, err_path)
        for p in (out_path, err_path):  # what housekeeping reads to delete them in time
            _write_atomic(p.with_suffix(".expires"), str(expires_at).encode())


def _newest_first(f: StoredFile) -> tuple[int, str]:
    return -f.info.get("uploaded_ns", f.meta["created_at"] * 10**9), f.meta["id"]


def _expired(meta: dict[str, Any]) -> bool:
    return meta.get("expires_at") is not None and meta["expires_at"] <= time.time()


def _all_results(r: redis.Redis, batch_id: str) -> Iterator[Any]:
    cursor = "0"
    while True:
        page = read_results(r, batch_id, cursor)
        if not page.results:
            return
        yield from page.results
        cursor = page.cursor


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(f".{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
