"""The docs site builds and runs: `mkdocs build --strict` passes and fails on a broken internal link, the
README's links reach their pages, every fenced block names its language, and every shell example is run
(here, or by the test its marker names) unless its marker says why it cannot run here."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from docs_helpers import DOCS, ROOT, Block, blocks, pages, shell_blocks, text

MKDOCS = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
needs_mkdocs = pytest.mark.skipif(MKDOCS is None, reason="mkdocs is not installed (the dev extra pins it)")


# ---- the site -----------------------------------------------------------------------------------------
def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    assert MKDOCS
    return subprocess.run([MKDOCS, "build", "--strict", "-f", str(config), "-d", str(site)], capture_output=True,
                          text=True, timeout=300)


@needs_mkdocs
def test_the_site_builds_strict(tmp_path: Path) -> None:
    done = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "configuration" / "index.html").exists()


@needs_mkdocs
@pytest.mark.parametrize("link", ["[a page](no-such-page.md)", "[an anchor](configuration.md#no-such-section)"])
def test_a_broken_internal_link_fails_the_build(tmp_path: Path, link: str) -> None:
    shutil.copytree(DOCS, tmp_path / "docs")  # links followed: ARCHITECTURE.md and bench/results come along
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "kv-int8.md").open("a") as f:
        f.write(f"\nSee {link}.\n")
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0 and "kv-int8.md" in done.stderr, done.stderr


def _slug(title: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc) gives a heading."""
    return re.sub(r"[\s-]+", "-", re.sub(r"[^\w\s-]", "", title.lower()).strip())


def test_the_readmes_links_reach_their_pages_and_sections() -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", text("README.md"))
    local = [link for link in links if not re.match(r"\w+://", link)]
    assert len(local) >= 15
    for link in local:
        path, _, anchor = link.partition("#")
        assert (ROOT / path).exists(), f"the README links {link}: no such file"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", (ROOT / path).read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"the README links {link}: no such section"


def test_every_docs_page_is_in_the_nav() -> None:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = {page for entry in nav for page in entry.values()}
    assert listed == {p.name for p in DOCS.glob("*.md")}


# ---- the code blocks ----------------------------------------------------------------------------------
def test_every_fenced_block_names_its_language() -> None:
    """So a shell example cannot hide from the runner below as an unlabelled block."""
    unnamed = [b.id for b in blocks() if not b.lang]
    assert not unnamed, f"fenced blocks without a language (bash, python, jsonl, json, text): {unnamed}"


def _tested_by_exists(reason: str) -> bool:
    file, _, name = reason.partition("::")
    path = ROOT / file
    return path.exists() and name in {f.name for f in ast.parse(path.read_text()).body if isinstance(f, ast.FunctionDef)}


def test_every_shell_example_is_run_or_says_why_not(capsys: pytest.CaptureFixture[str]) -> None:
    shell = shell_blocks()
    skipped = [b for b in shell if b.mark == "skip"]
    elsewhere = [b for b in shell if b.mark == "tested-by"]
    here = [b for b in shell if b.mark is None]
    for b in skipped:
        assert b.reason and len(b.reason) > 10, f"{b.id}: a skipped example says why it cannot run here"
    for b in elsewhere:
        assert b.reason and _tested_by_exists(b.reason), f"{b.id}: no test {b.reason}"
    assert len(here) + len(elsewhere) >= 3
    with capsys.disabled():
        print(f"\n{len(shell)} shell examples in {len(pages())} pages: {len(here)} run by tests/project/test_docs.py, "
              f"{len(elsewhere)} by the test their marker names, {len(skipped)} marked as not runnable here")


# ---- the shell examples, run ------------------------------------------------------------------------------
def _env(home: Path, model: Path) -> dict[str, str]:
    """A fresh SLUICE_HOME, the tiny model as the default model, the venv's `sluice` first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    return {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "SLUICE_HOME": str(home),
            "SLUICE_MODEL": str(model), "SLUICE_DTYPE": "float32", "SLUICE_KV_CACHE_MEMORY": "16MiB"}


def _stop_group(pgid: int) -> None:
    """What the example left running in the background (a worker): SIGTERM, then SIGKILL past a bound."""
    for sig, bound in ((signal.SIGTERM, 90.0), (signal.SIGKILL, 10.0)):
        end = time.monotonic() + bound
        try:
            os.killpg(pgid, sig)
            while time.monotonic() < end:
                os.killpg(pgid, 0)
                time.sleep(0.2)
        except ProcessLookupError:
            return
    pytest.fail(f"the example's processes outlived SIGKILL (group {pgid})")


def _outputs(body: str) -> list[tuple[Path, Path]]:
    """(input, output) of each `sluice generate|submit IN ... -o OUT` line of the example."""
    found = []
    for line in body.replace("\\\n", " ").splitlines():  # a continued line is one command
        words = shlex.split(line, comments=True)
        if words[:1] == ["sluice"] and words[1:2] in (["generate"], ["submit"]) and "-o" in words:
            found.append((Path(words[2]), Path(words[words.index("-o") + 1])))
    return found


def _check_results(cwd: Path, source: Path, output: Path) -> None:
    """One result per input line, each completed, and no errors file with anything in it."""
    ids = [json.loads(line)["custom_id"] for line in (cwd / source).read_text().splitlines()]
    results = [json.loads(line) for line in (cwd / output).read_text().splitlines()]
    assert sorted(r["custom_id"] for r in results) == sorted(ids), output
    assert all(r["error"] is None and r["response"]["status_code"] == 200 for r in results), results
    errors = cwd / output.with_name(output.name.replace(".jsonl", ".errors.jsonl"))
    assert not errors.exists() or not errors.read_text(), errors.read_text()


RUN_HERE = [b for b in shell_blocks() if b.mark is None]


@pytest.mark.timeout(1800)  # a first build of the C++ ops can take minutes
@pytest.mark.parametrize("block", RUN_HERE, ids=[b.id for b in RUN_HERE])
def test_the_shell_example_runs(block: Block, tiny_model_dir: Path, tmp_path: Path) -> None:
    """As written, in an empty folder that has the checkout's cli/samples/, with its own job server."""
    cwd, home = tmp_path / "work", tmp_path / "home"
    cwd.mkdir()
    (cwd / "cli").symlink_to(ROOT / "cli")
    env, log = _env(home, tiny_model_dir), tmp_path / "example.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", block.body], cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = proc.wait(timeout=1700)
        finally:
            _stop_group(proc.pid)
            stopped = subprocess.run(["sluice", "server", "stop"], env=env, capture_output=True, text=True)
    assert rc == 0, log.read_text()
    assert stopped.returncode == 0, stopped.stderr
    for source, output in _outputs(block.body):
        _check_results(cwd, source, output)
    status = subprocess.run(["sluice", "server", "status"], env=env, capture_output=True, text=True)
    assert status.returncode == 4, f"a job server is left running:\n{status.stdout}"
