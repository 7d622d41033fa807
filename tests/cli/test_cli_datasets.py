"""`sluice generate` on datasets: Parquet, CSV, JSONL rows and a save_to_disk directory in, Parquet,
JSONL and CSV out with the source's columns kept, object storage through a real S3-compatible server,
a bad row failing alone with its row number, flag mistakes as one-line usage errors, a missing extra
named, and --resume after a kill -9 giving every row exactly once. Completions are checked against the
tiny model's own answers to the same requests (greedy: one right answer)."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from helpers import fresh_seed
from sluice.cli.common import EXIT_SOME_FAILED, EXIT_USAGE, EXIT_USER_ERROR
from sluice.cli.main import cli
from sluice.jobs.datasets import Request, RowSpec, open_source, read_requests
from sluice.jobs.lines import parse_line

pytest_plugins = ["s3_fixtures"]  # `s3`: a real S3-compatible server (moto's server mode)

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["river", "lamp", "cloud", "stone", "seven", "blue", "quiet", "north", "ünï", "{x}"]
ENGINE = ["--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-num-seqs", "8", "--no-progress"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Any:
    from sluice.engine.llm import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=8, kv_cache_memory=8 << 20)


def make_rows(rng: random.Random, n: int, bad: int | None = None) -> list[dict[str, Any]]:
    """Rows with an id, a text (None at row ``bad``: that row cannot render) and a column no request uses."""
    return [{"id": f"r{i}-{rng.randrange(10**6)}",
             "text": None if i == bad else " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))),
             "keep": rng.randint(-100, 100)} for i in range(n)]


def reference(llm: Any, source: str, spec: RowSpec, max_tokens: int) -> dict[str, str]:
    """The tiny model's own completions for the requests the rows make, by custom_id."""
    from sluice.jobs.schemas import SamplingParams
    from sluice.worker.convert import job_to_request

    jobs = [parse_line(i.line, i.row + 1, SamplingParams(max_tokens=max_tokens))
            for i in read_requests(source, spec) if isinstance(i, Request)]
    return {c.request_id: c.outputs[0].text for c in llm.generate([job_to_request(j, j.custom_id) for j in jobs])}


def rows_of(url: str, fmt: str | None = None) -> list[dict[str, Any]]:
    return [r for b in open_source(url, format=fmt).blocks() for r in b.rows()]


def generate(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, ["generate", *map(str, args)])


def check_joined(out: list[dict[str, Any]], src: list[dict[str, Any]], want: dict[str, str], ids: list[str],
                 max_tokens: int, as_text: bool = False) -> None:
    """One output row per source row, in order, source columns as they were, each good row's completion
    the model's, each bad row an error naming its row."""
    assert len(out) == len(src)
    for n, (o, s, cid) in enumerate(zip(out, src, ids, strict=True)):
        assert {k: o[k] for k in s} == s, n  # the source's columns intact
        error, usage = (json.loads(o[k]) if as_text and o[k] else o[k] for k in ("error", "usage"))
        if cid not in want:
            assert error["message"].startswith(f"row {n}: ") and o["completion"] in (None, ""), o
            continue
        assert error is None and o["completion"] == want[cid], (n, o)
        assert o["finish_reason"] in ("stop", "length") and 1 <= int(usage["completion_tokens"]) <= max_tokens


def test_parquet_in_parquet_out(tiny_model_dir: Path, llm: Any, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 23, bad=rng.randrange(23))
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src, row_group_size=5)
    res = generate(src, "-o", out, "--model", tiny_model_dir, *ENGINE, "--prompt-column", "text",
                   "--id-column", "id", "--max-tokens", "4")
    assert res.exit_code == EXIT_SOME_FAILED, res.output  # the one bad row
    assert "23 rows: 22 completed, 1 failed" in res.stderr
    want = reference(llm, str(src), RowSpec(prompt_column="text", id_column="id"), 4)
    check_joined(rows_of(str(out)), rows, want, [r["id"] for r in rows], 4)
    assert pq.read_schema(out).names == ["id", "text", "keep", "completion", "finish_reason", "usage", "error"]
    bad = next(r for r in rows_of(str(out)) if r["text"] is None)
    assert bad["error"]["code"] == "missing_value" and "column 'text' is empty" in bad["error"]["message"]


def test_csv_in_jsonl_out_with_a_template_and_a_system_message(tiny_model_dir: Path, llm: Any, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 12)
    src, out = tmp_path / "in.csv", tmp_path / "out.jsonl"
    pa_csv.write_csv(pa.Table.from_pylist(rows), src)
    flags = ["--template", "Say {text} ({keep})", "--system", "Be brief."]
    res = generate(src, "-o", out, "--model", tiny_model_dir, *ENGINE, *flags, "--max-tokens", "3")
    assert res.exit_code == 0, res.output
    src_rows = rows_of(str(src))  # CSV: every column text
    assert src_rows[0]["keep"] == str(rows[0]["keep"])
    spec = RowSpec(template="Say {text} ({keep})", system="Be brief.")
    first = json.loads(next(i for i in read_requests(str(src), spec)).line)  # type: ignore[union-attr]
    assert first["messages"] == [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": f"Say {rows[0]['text']} ({rows[0]['keep']})"}]
    want = reference(llm, str(src), spec, 3)
    check_joined(rows_of(str(out)), src_rows, want, [str(i) for i in range(12)], 3)  # ids: the row numbers


def test_a_row_without_the_column_fails_alone_with_its_row_number(tiny_model_dir: Path, tmp_path: Path) -> None:
    """JSONL rows need not share their keys: the row lacking the prompt column is that row's error."""
    rows = [{"text": "one two", "n": 1}, {"title": "no text here", "n": 2}, {"text": "three", "n": 3}]
    src, out = tmp_path / "rows.jsonl", tmp_path / "out.csv"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = generate(src, "-o", out, "--model", tiny_model_dir, *ENGINE, "--prompt-column", "text",
                   "--max-tokens", "2")
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    got = rows_of(str(out))
    assert [r["n"] for r in got] == ["1", "2", "3"]
    errors = [json.loads(r["error"]) if r["error"] else None for r in got]
    assert errors[0] is None and errors[2] is None and got[0]["completion"] and got[2]["completion"]
    assert errors[1] == {"code": "missing_column", "message": "row 1: no column 'text'"}


def test_a_saved_dataset_directory(tiny_model_dir: Path, llm: Any, tmp_path: Path) -> None:
    import datasets

    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 9)
    saved, out = tmp_path / "saved", tmp_path / "out.parquet"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    res = generate(saved, "-o", out, "--model", tiny_model_dir, *ENGINE, "--messages-column", "chat",
                   "--max-tokens", "3")
    assert res.exit_code == EXIT_USAGE and "no column 'chat'" in res.output  # checked before the model loads
    res = generate(saved, "-o", out, "--model", tiny_model_dir, *ENGINE, "--template", "{text}!", "--id-column",
                   "id", "--max-tokens", "3")
    assert res.exit_code == 0, res.output
    want = reference(llm, str(saved), RowSpec(template="{text}!", id_column="id"), 3)
    check_joined(rows_of(str(out)), rows, want, [r["id"] for r in rows], 3)


def test_object_storage_in_and_out(s3: dict[str, Any], tiny_model_dir: Path, llm: Any, tmp_path: Path) -> None:
    """The real command in a process of its own; s3fs finds the server through AWS_ENDPOINT_URL, as a
    user of an S3-compatible store would point it."""
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 14, bad=5)
    local = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), local)
    s3["fs"].put(str(local), "s3://sluice-test/in/rows.parquet")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AWS_ENDPOINT_URL": s3["opts"]["endpoint_url"]}
    p = subprocess.run([sys.executable, "-m", "sluice.cli.main", "generate", "s3://sluice-test/in/rows.parquet", "-o",
                        "s3://sluice-test/out/rows.jsonl", "--model", str(tiny_model_dir), *ENGINE,
                        "--prompt-column", "text", "--id-column", "id", "--max-tokens", "3"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == EXIT_SOME_FAILED, p.stderr
    with s3["fs"].open("s3://sluice-test/out/rows.jsonl", "rb") as f:
        out = [json.loads(x) for x in f.read().decode().splitlines()]
    want = reference(llm, str(local), RowSpec(prompt_column="text", id_column="id"), 3)
    check_joined(out, rows, want, [r["id"] for r in rows], 3)


def test_flag_mistakes_are_one_line_usage_errors(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a", "b"]}), src)
    out = str(tmp_path / "out.parquet")
    cases = [
        (["--prompt-column", "text", "--template", "{text}"], "give one of --prompt-column, --messages-column, "
         "--template, --template-file (got --prompt-column, --template)"),
        (["--prompt-column", "body"], "no column 'body' in the source (columns: text)"),
        (["--template", "Say {body}"], "no column 'body' in the source"),
        (["--id-column", "id", "--prompt-column", "text"], "no column 'id' in the source"),
        ([], "no column 'prompt' or 'messages' in the source (columns: text)"),
    ]
    for flags, text in cases:
        res = generate(src, "-o", out, *flags)
        assert res.exit_code == EXIT_USAGE, (flags, res.output)
        assert res.stderr.strip().splitlines() == [f"Error: {res.stderr.strip().removeprefix('Error: ')}"]
        assert text in res.stderr, (flags, res.stderr)
    assert not Path(out).exists()
    res = generate(src, "-o", "-", "--prompt-column", "text")
    assert res.exit_code == EXIT_USAGE and "not stdin or stdout" in res.stderr
    for missing in ("missing.parquet", "missing.jsonl"):  # a dataset, and JSONL lines as ever
        res = generate(tmp_path / missing, "-o", out)
        assert res.exit_code == EXIT_USAGE
        assert res.stderr == f"Error: Invalid value for 'INPUT_FILE': Path '{tmp_path / missing}' does not exist.\n"


def _cli_without(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys; sys.modules[{module!r}] = None; from sluice.cli.main import cli; cli({list(args)!r})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_missing_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a"]}), src)
    p = _cli_without("pyarrow", "generate", str(src), "-o", str(tmp_path / "o.parquet"), "--prompt-column", "text")
    assert p.returncode == EXIT_USER_ERROR
    assert p.stderr.strip() == ("Error: dataset inputs and outputs need pyarrow, which is not installed: "
                                "pip install 'sluice-llm[datasets]'")
    p = _cli_without("s3fs", "generate", "s3://bucket/in.parquet", "-o", str(tmp_path / "o.parquet"))
    assert p.returncode == EXIT_USER_ERROR
    assert p.stderr.strip() == "Error: s3:// URLs needs s3fs, which is not installed: pip install 'sluice-llm[s3]'"


# ---- --resume after kill -9 ---------------------------------------------------------------------------
def _journal_results(journal: Path) -> int:
    try:
        with sqlite3.connect(journal) as db:
            return int(db.execute("SELECT COUNT(*) FROM results").fetchone()[0])
    except sqlite3.OperationalError:
        return 0  # not made yet


def test_resume_after_kill_9_gives_every_row_exactly_once(tiny_model_dir: Path, llm: Any, tmp_path: Path) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    n = 90
    rows = make_rows(rng, n, bad=rng.randrange(n))
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src, row_group_size=16)
    # Paced (tests/support/paced.py): the run is still going when the test kills it, on any machine.
    args = [sys.executable, str(ROOT / "tests" / "support" / "paced.py"), "sluice.cli.main", "generate", str(src), "-o", str(out), "--model", str(tiny_model_dir),
            "--dtype", "float32", "--kv-cache-memory", "8MiB", "--max-num-seqs", "4", "--no-progress",
            "--prompt-column", "text", "--id-column", "id", "--max-tokens", "12"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this worktree's code, not the installed copy's
    proc = subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True)
    journal = Path(f"{out}.sluice-journal")
    deadline = time.monotonic() + 900  # a give-up limit: a loaded machine can take minutes to start a process
    while time.monotonic() < deadline and proc.poll() is None and _journal_results(journal) < 20:
        time.sleep(0.05)  # wait on progress (results in the journal), not on the clock
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    with sqlite3.connect(journal) as db:
        kept = {cid: json.loads(cols) for cid, cols in db.execute("SELECT custom_id, cols FROM results")}
    assert 20 <= len(kept) < n - 1, "the run was to be killed part-way"

    p = subprocess.run([*args, "--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == EXIT_SOME_FAILED, p.stderr  # the one bad row
    assert f"resuming: {len(kept)} rows already have a result" in p.stderr
    assert f"{n} rows: {n - 1} completed, 1 failed" in p.stderr
    got = rows_of(str(out))
    assert [r["id"] for r in got] == [r["id"] for r in rows]  # every row exactly once, in order
    want = reference(llm, str(src), RowSpec(prompt_column="text", id_column="id"), 12)
    check_joined(got, rows, want, [r["id"] for r in rows], 12)
    for r in got:
        if r["id"] in kept:  # what the killed run wrote is what the output holds
            assert r["completion"] == kept[r["id"]]["completion"]
    assert not journal.exists()
    print(textwrap.shorten(f"seed {seed}: killed after {len(kept)} of {n} rows", 200))



# ---- issue 40, items 8 and 9: real `sluice generate` processes -----------------------------------------
def sluice(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """`sluice ARGS` in a process of its own, on this worktree's code."""
    return subprocess.run([sys.executable, "-m", "sluice.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_resume_refuses_another_sources_finished_output(tiny_model_dir: Path, llm: Any, tmp_path: Path) -> None:
    """Issue 40, item 8: OUT is the finished output of A; `generate B -o OUT --resume` with B's rows under
    the same ids (one text differs) exited 0 with A's completions on B's rows. Now it is refused in one
    line naming the row, before a model loads, leaving OUT as it was and no journal; A itself resumes
    with nothing to run."""
    seed = fresh_seed()
    rng = random.Random(seed)
    n = 12
    rows = make_rows(rng, n)
    other = [dict(r) for r in rows]
    k = rng.randrange(n)
    other[k]["text"] += " more"
    a, b, out = tmp_path / "a.parquet", tmp_path / "b.parquet", tmp_path / "out.jsonl"
    pq.write_table(pa.Table.from_pylist(rows), a)
    pq.write_table(pa.Table.from_pylist(other), b)
    flags = ["--model", tiny_model_dir, *ENGINE, "--prompt-column", "text", "--id-column", "id", "--max-tokens", "3"]
    p = sluice("generate", a, "-o", out, *flags)
    assert p.returncode == 0, (seed, p.stderr)
    before = out.read_bytes()

    p = sluice("generate", b, "-o", out, *flags, "--resume")
    assert p.returncode == EXIT_USER_ERROR, (seed, p.stderr)
    assert p.stderr == (f"Error: cannot resume: {out} is not the output of {b} (its row {k}: the source holds "
                        "another row there); start without --resume, or resume with the source it was made from\n"), seed
    assert out.read_bytes() == before, seed
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.parquet", "b.parquet", "out.jsonl"], seed  # no journal

    p = sluice("generate", a, "-o", out, *flags, "--resume")
    assert p.returncode == 0, (seed, p.stderr)
    assert f"resuming: {n} rows already have a result" in p.stderr and f"{n} rows: {n} completed" in p.stderr, seed
    got = rows_of(str(out))
    want = reference(llm, str(a), RowSpec(prompt_column="text", id_column="id"), 3)
    check_joined(got, rows, want, [r["id"] for r in rows], 3)


def test_a_csv_with_a_bad_byte_and_a_huge_cell_fails_only_that_row(tiny_model_dir: Path, llm: Any,
                                                                   tmp_path: Path) -> None:
    """Issue 40, item 9: one row's byte that is not UTF-8 fails that row, by its number (it failed the
    whole run as "row 0"), keeping its other cells; a 9 MiB cell in a column no request reads is carried whole (it failed the run:
    "straddling object"); every other row runs. Repeated column names, CSV or Parquet, are refused in one
    line naming them (a column was dropped, or a traceback), before a model loads."""
    seed = fresh_seed()
    rng = random.Random(seed)
    n = 14
    bad, big = rng.sample(range(n), 2)
    rows = make_rows(rng, n)
    lines = [b"id,text,keep\n"]
    for i, r in enumerate(rows):
        text = r["text"].encode() + (b" \xfe" if i == bad else b"")
        keep = b"k" * (9 << 20) if i == big else str(r["keep"]).encode()
        lines.append(b'%s,"%s",%s\n' % (r["id"].encode(), text.replace(b'"', b'""'), keep))
    src, out = tmp_path / "in.csv", tmp_path / "out.parquet"
    src.write_bytes(b"".join(lines))
    p = sluice("generate", src, "-o", out, "--model", tiny_model_dir, *ENGINE, "--prompt-column", "text",
               "--id-column", "id", "--max-tokens", "3")
    assert p.returncode == EXIT_SOME_FAILED, (seed, p.stderr)
    assert f"{n} rows: {n - 1} completed, 1 failed" in p.stderr and "Traceback" not in p.stderr, seed
    got = rows_of(str(out))
    assert [g["id"] for g in got] == [r["id"] for r in rows], seed  # the bad row keeps its readable cells
    assert got[bad]["text"] is None and got[bad]["keep"] == str(rows[bad]["keep"]), seed
    assert got[bad]["error"]["code"] == "invalid_line", seed
    assert got[bad]["error"]["message"].startswith(f"row {bad}: not UTF-8 (column 'text', byte "), seed
    assert len(got[big]["keep"]) == 9 << 20 and got[big]["error"] is None and got[big]["completion"], seed
    want = reference(llm, str(src), RowSpec(prompt_column="text", id_column="id"), 3)
    assert all(g["completion"] == want[g["id"]] for i, g in enumerate(got) if i != bad), seed

    for fmt in ("csv", "parquet"):
        dup, dup_out = tmp_path / f"dup.{fmt}", tmp_path / f"dup-out.{fmt}"
        if fmt == "csv":
            dup.write_text("id,text,id\na,hello,b\n")
        else:
            pq.write_table(pa.table([pa.array(["a"]), pa.array(["hello"]), pa.array(["b"])],
                                    names=["id", "text", "id"]), dup)
        p = sluice("generate", dup, "-o", dup_out, "--model", tiny_model_dir, *ENGINE, "--prompt-column", "text")
        assert p.returncode == EXIT_USER_ERROR, p.stderr
        assert p.stderr == f"Error: {dup}: duplicate column names 'id' (each column needs a name of its own)\n"
        assert not dup_out.exists() and not list(tmp_path.glob("*journal*"))
