"""The documentation as the tests read it: README.md, the mkdocs pages in docs/ and ARCHITECTURE.md, and
their fenced blocks with the `<!-- docs-test: ... -->` marker (if any) written just above each."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SHELL = ("bash", "sh", "shell")
# Above a shell block: why it cannot run here (`skip: REASON`), or which test runs it (`tested-by: FILE::NAME`).
MARK = re.compile(r"<!-- docs-test: (skip|tested-by): (.+?) -->\n$")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    page: str  # README.md, ARCHITECTURE.md or docs/NAME.md
    line: int  # of the opening fence
    lang: str
    body: str
    mark: str | None  # "skip" or "tested-by"
    reason: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    """Every page a reader sees: docs/architecture.md is ARCHITECTURE.md (a link), read once as itself;
    docs/results/ is bench/results/ (the benchmarks' own output, not prose)."""
    docs = sorted(p for p in DOCS.glob("*.md") if not p.is_symlink())
    return [ROOT / "README.md", *docs, ROOT / "ARCHITECTURE.md"]


@cache
def text(page: str) -> str:
    return (ROOT / page).read_text()


@cache
def all_text() -> str:
    """Every page, one after another (each starts with its title, so sections end at the next page)."""
    return "\n".join(p.read_text() for p in pages())


def blocks() -> list[Block]:
    found = []
    for path in pages():
        page = str(path.relative_to(ROOT))
        t = text(page)
        for m in FENCE.finditer(t):
            before = t[:m.start()]
            mark = MARK.search(before[before.rfind("\n", 0, len(before) - 1) + 1:])
            found.append(Block(page, before.count("\n") + 1, m[1], m[2], mark and mark[1], mark and mark[2]))
    return found


def shell_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang in SHELL]
