"""Datasets in (jobs/datasets): every input format read to request lines in row order, each way a row
becomes a request, rows that do not render failing alone with their row number, spec errors before
any row, in-memory data, the seam with the queue, a missing extra named, and no torch in the job plane."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dataset_helpers import (
    SPEC,
    check_output,
    expected_job,
    job_of,
    make_rows,
    read_output,
    run_writer,
    write_source,
)
from helpers import fresh_seed
from sluice.jobs.datasets import (
    MissingExtra,
    Request,
    RowError,
    RowSpec,
    SourceError,
    SpecError,
    open_data,
    open_source,
    read_requests,
)

pytest_plugins = ["jobs_fixtures"]  # `r`: the test's own Valkey

ROOT = Path(__file__).resolve().parents[2]


# ---- inputs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "parquet", "parquet-dir", "csv", "saved", "saved-dict",
                                 "file-url"])
def test_each_input_format_gives_one_request_per_row_in_order(fmt: str, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 53)
    src = write_source(rows, fmt, tmp_path)
    source = open_source(src, split="train" if fmt == "saved-dict" else None)
    items = list(read_requests(source, SPEC, rows=10))
    assert [i.row for i in items] == list(range(len(rows)))
    assert all(isinstance(i, Request) for i in items), [str(i) for i in items if isinstance(i, RowError)]
    for item, row in zip(items, rows, strict=True):
        job = job_of(item.line, item.row)
        want = expected_job(row)
        assert item.custom_id == job.custom_id == want["custom_id"]
        assert job.messages == want["messages"]
        assert (job.params.temperature, job.params.max_tokens) == (want["temperature"], want["max_tokens"])


def test_a_saved_dataset_dict_needs_a_split_when_it_has_several(tmp_path: Path) -> None:
    src = write_source(make_rows(random.Random(1), 5), "saved-dict", tmp_path)
    with pytest.raises(SourceError, match="splits train, test"):
        list(read_requests(src, SPEC))
    test_split = list(read_requests(open_source(src, split="test"), SPEC))
    assert len(test_split) == 1


def test_rows_that_do_not_render_are_errors_naming_their_row_and_the_rest_run(tmp_path: Path) -> None:
    lines = [
        {"id": "a", "text": "fine"},
        {"id": "b"},  # no text column
        {"id": "c", "text": None},  # null
        "not json {",
        [1, 2],  # JSON, not an object
        {"id": "a", "text": "again"},  # a repeated id
        {"id": None, "text": "no id"},
        {"id": 7, "text": "an integer id is fine"},
        {"id": "d", "text": "hot", "temperature": "hot"},  # a per-row setting that does not validate
        {"id": "e", "text": "too many tokens", "max_tokens": 0},
        {"id": 2.5, "text": "a float id"},
        {"id": "f", "text": "{braces} in a value are not a template"},
    ]
    p = tmp_path / "rows.jsonl"
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n\n" for x in lines))  # blank lines: no rows
    items = list(read_requests(str(p), RowSpec(template="T: {text}", id_column="id")))
    assert [i.row for i in items] == list(range(len(lines)))
    bad = {i.row: i for i in items if isinstance(i, RowError)}
    assert {r: e.code for r, e in bad.items()} == {
        1: "missing_column", 2: "missing_value", 3: "invalid_line", 4: "invalid_line", 5: "duplicate_custom_id",
        6: "invalid_custom_id", 8: "invalid_request", 9: "invalid_request", 10: "invalid_custom_id"}
    assert "no column 'text'" in str(bad[1]) and str(bad[1]).startswith("row 1: ")
    assert "not valid JSON" in bad[3].message and "temperature" in bad[8].message
    good = {i.row: job_of(i.line, i.row) for i in items if isinstance(i, Request)}
    assert good[7].custom_id == "7"
    assert good[11].messages == [{"role": "user", "content": "T: {braces} in a value are not a template"}]


def test_row_modes_prompt_messages_jinja_and_raw_prompts(tmp_path: Path) -> None:
    messages = [[{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"},
                 {"role": "user", "content": "more"}] for i in range(4)]
    rows = [{"q": f"question {i}", "topic": ["cats", "dogs"][i % 2], "msgs": messages[i], "n": i + 1}
            for i in range(4)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    by_prompt = [job_of(r.line, r.row) for r in read_requests(src, RowSpec(prompt_column="q"))]
    assert [j.messages for j in by_prompt] == [[{"role": "user", "content": r["q"]}] for r in rows]
    assert [j.custom_id for j in by_prompt] == ["0", "1", "2", "3"]  # the row number by default
    assert [j.params.n for j in by_prompt] == [r["n"] for r in rows]  # a column named like a setting sets it
    raw = [job_of(r.line, r.row) for r in read_requests(src, RowSpec(prompt_column="q", chat=False))]
    assert [(j.kind, j.prompt) for j in raw] == [("completion", r["q"]) for r in rows]
    by_messages = [job_of(r.line, r.row) for r in read_requests(src, RowSpec(messages_column="msgs", system="S"))]
    assert [j.messages for j in by_messages] == [[{"role": "system", "content": "S"}] + m for m in messages]
    tpl = tmp_path / "t.j2"
    tpl.write_text("Write {{ n }} words on {{ topic | upper }}{% if n > 2 %}, carefully{% endif %}.")
    jinja = [job_of(r.line, r.row) for r in read_requests(src, RowSpec(template_file=str(tpl)))]
    assert {j.params.n for j in jinja} == {1}  # a column the template reads is not also a setting
    assert [j.messages[0]["content"] for j in jinja] == [
        f"Write {r['n']} words on {r['topic'].upper()}{', carefully' if r['n'] > 2 else ''}." for r in rows]
    # Messages kept as JSON text (a CSV) work too; a row whose text is not messages is that row's error.
    csv = tmp_path / "m.csv"
    csv.write_text('m\n"[{""role"": ""user"", ""content"": ""hi""}]"\nnot messages\n')
    got = list(read_requests(str(csv), RowSpec(messages_column="m")))
    assert job_of(got[0].line, 0).messages == [{"role": "user", "content": "hi"}]
    assert isinstance(got[1], RowError) and got[1].code == "invalid_messages"


def test_spec_errors_are_found_before_any_row(tmp_path: Path) -> None:
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "x"}]), src)
    with pytest.raises(SpecError, match="no column 'body'"):
        next(read_requests(src, RowSpec(template="{body}")))
    with pytest.raises(SpecError, match="no column 'prompt' or 'messages'.*columns: text"):
        next(read_requests(src, RowSpec()))  # neither prompt nor messages, and no spec
    with pytest.raises(SpecError, match="give one of"):
        RowSpec(prompt_column="text", template="{text}")
    with pytest.raises(SpecError, match="template"):
        RowSpec(template="unclosed {text")
    bad_jinja = tmp_path / "bad.j2"
    bad_jinja.write_text("{% if %}")
    with pytest.raises(SpecError, match="line 1"):
        next(read_requests(src, RowSpec(template_file=str(bad_jinja))))
    (tmp_path / "in.txt").write_text("x")
    with pytest.raises(SourceError, match="cannot tell the format"):
        open_source(tmp_path / "in.txt")


def test_a_missing_source_and_an_unreachable_hub_fail_with_one_line(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file"):
        open_source(str(tmp_path / "nope.parquet"))
    # No network here: the Hub's repository form and its file form both fail with one clear line.
    for url in ("hf://datasets/sluice-test/none", "hf://datasets/sluice-test/none/data/train.parquet"):
        with pytest.raises(SourceError) as e:
            list(read_requests(url, RowSpec(prompt_column="text")))
        assert str(e.value).startswith(f"cannot read {url}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["list", "pandas", "polars", "table", "batch", "dataset"])
def test_in_memory_data_reads_and_joins_like_a_file(kind: str, tmp_path: Path) -> None:
    """What the Python API takes: a list of dicts, pandas / polars DataFrames, Arrow, a datasets.Dataset."""
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 45, nulls=True)
    table = pa.Table.from_pylist(rows)
    if kind == "list":
        data: Any = rows
    elif kind == "pandas":
        data = table.to_pandas()
    elif kind == "polars":
        import polars

        data = polars.from_arrow(table)
    elif kind == "table":
        data = table
    elif kind == "batch":
        data = table.to_batches()[0]
    else:
        import datasets

        data = datasets.Dataset.from_list(rows)
    source = open_data(data)
    fed, errors = run_writer(source, str(tmp_path / "out.parquet"), SPEC, rng, rows=10)
    assert {e.row for e in errors} == {i for i, r in enumerate(rows) if r["text"] is None}
    check_output(read_output(str(tmp_path / "out.parquet"), "parquet"), rows, fed, errors, SPEC)
    with pytest.raises(SourceError, match="cannot read a builtins.str as rows"):
        open_data("not rows")


# ---- the seam, extras, and the job plane's rule -------------------------------------------------
def test_rows_submit_to_the_queue_as_lines(r: Any, tmp_path: Path) -> None:
    """The lines go into sluice.jobs.submit.submit as a file's would; a bad row stays a blank line, so the
    batch's line numbers are row numbers + 1."""
    from sluice.jobs.submit import submit

    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 40, nulls=True)
    src = write_source(rows, "parquet", tmp_path)
    items = list(read_requests(src, SPEC))
    batch = submit(("" if isinstance(i, RowError) else i.line for i in items), r=r, model="m")
    assert batch.counts.total == sum(isinstance(i, Request) for i in items) == sum(x["text"] is not None for x in rows)
    assert batch.counts.invalid == 0


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          timeout=120)


def test_a_missing_extra_is_one_line_naming_it(tmp_path: Path) -> None:
    p = _run("import sys; sys.modules['pyarrow'] = None; import sluice.jobs.datasets")
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "sluice.jobs.datasets.extras.MissingExtra: this needs pyarrow, which is not installed: pip install 'sluice-llm[datasets]'")
    p = _run("""
        import sys; sys.modules['s3fs'] = None
        from sluice.jobs.datasets import MissingExtra, open_source
        try:
            open_source('s3://bucket/x.parquet')
        except MissingExtra as e:
            print(e)
        """)
    assert p.stdout.strip() == "s3:// URLs needs s3fs, which is not installed: pip install 'sluice-llm[s3]'"
    assert issubclass(MissingExtra, ImportError)


def test_the_datasets_package_does_not_import_torch(tmp_path: Path) -> None:
    src = write_source(make_rows(random.Random(2), 3), "saved", tmp_path)
    p = _run(f"""
        import sys
        from sluice.jobs.datasets import ResultsWriter, RowSpec, read_requests
        list(read_requests({src!r}, RowSpec(prompt_column="text")))
        print(sorted({{'torch', 'engine', 'worker'}} & set(sys.modules)))
        """)
    assert p.stdout.strip() == "[]", p.stderr


# ---- issue 40, item 9: bad CSV bytes, huge cells and repeated column names ---------------------------
def test_csv_bytes_that_are_not_utf8_fail_their_row_alone_by_its_number(tmp_path: Path) -> None:
    """A few rows past the first block (and the 4 MiB piece) hold bytes that are not UTF-8: each fails
    alone, named by its own row number and column; every other row reads as written."""
    seed = fresh_seed()
    rng = random.Random(seed)
    n = rng.randint(9_000, 12_000)
    bad = dict.fromkeys(sorted(rng.sample(range(n), 4)))
    pad = "x" * 400  # ~4.5 MB in all: more than one CSV piece
    lines = [b"text,keep\n"]
    for i in range(n):
        text, keep = f"row {i}".encode(), f"{pad}{i}".encode()
        if i in bad:
            col = bad[i] = rng.choice(["text", "keep"])
            cut = rng.randrange(3)
            if col == "text":
                text = text[:cut] + b"\xff" + text[cut:]
            else:
                keep = keep[:cut] + b"\xc3(" + keep[cut:]
        lines.append(text + b"," + keep + b"\n")
    src = tmp_path / "in.csv"
    src.write_bytes(b"".join(lines))
    items = list(read_requests(str(src), RowSpec(prompt_column="text")))
    assert [i.row for i in items] == list(range(n)), seed
    errors = {i.row: i for i in items if isinstance(i, RowError)}
    assert set(errors) == set(bad), seed
    for row, col in bad.items():
        e = errors[row]
        assert e.code == "invalid_line" and str(e).startswith(f"row {row}: not UTF-8 (column {col!r}, byte "), (seed, e)
    good = [i for i in items if isinstance(i, Request)]
    assert all(job_of(i.line, i.row).messages[0]["content"] == f"row {i.row}" for i in good), seed
    cells = [c for b in open_source(str(src)).blocks() for c in b.cells()]  # what an output keeps
    for row, col in bad.items():
        assert cells[row] is not None and cells[row][col] is None, seed
        other = "keep" if col == "text" else "text"
        assert cells[row][other] == (f"{pad}{row}" if other == "keep" else f"row {row}"), seed


def test_a_csv_cell_larger_than_a_piece_is_read(tmp_path: Path) -> None:
    """Cells of 5 to 17 MiB (pyarrow's reader failed the whole file on one over its block), the first
    right under the header: every row read, whole, in order."""
    seed = fresh_seed()
    rng = random.Random(seed)
    sizes = {0: 17 << 20, rng.randint(2, 40): 5 << 20, 41: (8 << 20) + rng.randrange(1000)}
    rows = [{"prompt": f"p{i}", "keep": ("k" * sizes[i]) if i in sizes else str(i)} for i in range(43)]
    src = tmp_path / "big.csv"
    with src.open("w") as f:
        f.write("prompt,keep\n")
        f.writelines(f'{r["prompt"]},"{r["keep"]}"\n' for r in rows)
    got = [r for b in open_source(str(src)).blocks() for r in b.rows()]
    assert [r["prompt"] for r in got] == [r["prompt"] for r in rows], seed  # type: ignore[index]
    assert [len(r["keep"]) for r in got] == [len(r["keep"]) for r in rows], seed  # type: ignore[index]
    assert got == rows, seed


@pytest.mark.parametrize("fmt", ["csv", "parquet", "table"])
def test_repeated_column_names_are_refused_naming_them(fmt: str, tmp_path: Path) -> None:
    table = pa.table([pa.array(["hi"]), pa.array(["1"]), pa.array(["2"]), pa.array(["3"]), pa.array(["4"])],
                     names=["prompt", "x", "y", "x", "y"])
    if fmt == "csv":
        (tmp_path / "dup.csv").write_text("prompt,x,y,x,y\nhi,1,2,3,4\n")
        source: Any = str(tmp_path / "dup.csv")
    elif fmt == "parquet":
        pq.write_table(table, tmp_path / "dup.parquet")
        source = str(tmp_path / "dup.parquet")
    else:
        source = open_data(table)
    with pytest.raises(SourceError) as e:
        list(read_requests(source))
    assert str(e.value).endswith("duplicate column names 'x', 'y' (each column needs a name of its own)")
    src = source if fmt == "table" else open_source(source)
    with pytest.raises(SourceError, match="duplicate column names 'x', 'y'"):
        list(src.blocks())


def test_csv_rows_with_the_wrong_field_count_fail_alone_by_their_number(tmp_path: Path) -> None:
    """A row with fewer or more fields than the header (one past the first 4 MiB piece too) fails alone,
    named by its own row number, and every other row of its piece reads as written, a quoted cell with a
    comma, a newline or a non-UTF-8 byte included (pyarrow refused the whole file: "Expected 2 columns"; a
    bad row among the first lines failed it in reading the header)."""
    seed = fresh_seed()
    rng = random.Random(seed)
    n = rng.randint(9_000, 12_000)
    short = rng.randrange(100)  # in the first 64 KiB, the read that finds the header (it failed the file)
    long_, utf = sorted(rng.sample(range(100, n), 2))
    pad = "x" * 400  # ~4.5 MB in all: more than one CSV piece
    lines = [b"text,keep\n"]
    for i in range(n):
        text = f'"row {i}, quoted\nover two lines"' if i % 7 == 0 else f"row {i}"
        row = text.encode() + b"," + f"{pad}{i}".encode()
        if i == short:
            row = text.encode()
        elif i == long_:
            row += b",extra"
        elif i == utf:
            row += b"\xff"
        lines.append(row + b"\n")
    src = tmp_path / "in.csv"
    src.write_bytes(b"".join(lines))
    items = list(read_requests(str(src), RowSpec(prompt_column="text")))
    assert [i.row for i in items] == list(range(n)), seed
    errors = {i.row: str(i) for i in items if isinstance(i, RowError)}
    assert set(errors) == {short, long_, utf}, (seed, errors)
    assert errors[short] == f"row {short}: 1 fields where the header has 2", seed
    assert errors[long_] == f"row {long_}: 3 fields where the header has 2", seed
    assert errors[utf].startswith(f"row {utf}: not UTF-8 (column 'keep', byte "), seed
    want = {i: f"row {i}, quoted\nover two lines" if i % 7 == 0 else f"row {i}" for i in range(n)}
    good = [i for i in items if isinstance(i, Request)]
    assert len(good) == n - 3 and all(job_of(i.line, i.row).messages[0]["content"] == want[i.row]
                                      for i in good), seed


def test_a_quoted_newline_at_a_piece_boundary_stays_in_its_cell(tmp_path: Path) -> None:
    """The last newline before a 4 MiB piece's end lies inside a quoted cell (with a doubled "" before it):
    the piece ends after that row, not inside it (a row was split in two, or the run failed)."""
    from sluice.jobs.datasets.readers import CSV_BLOCK

    seed = fresh_seed()
    rng = random.Random(seed)
    lines = [b"text,keep\n"]
    size = len(lines[0])
    while size < CSV_BLOCK - 500:
        lines.append(b"r%d,%s\n" % (len(lines), b"x" * rng.randint(50, 150)))
        size += len(lines[-1])
    cell = 'he said ""hi""' + "a" * (CSV_BLOCK - size - 30) + "\nsecond half"  # its newline ends the piece
    lines.append(f'"{cell}",k\n'.encode())
    lines.append(b"last,row\n")
    src = tmp_path / "in.csv"
    src.write_bytes(b"".join(lines))
    got = [r for b in open_source(str(src)).blocks() for r in b.rows()]
    assert len(got) == len(lines) - 1, seed
    assert got[-2] == {"text": cell.replace('""', '"'), "keep": "k"}, seed
    assert got[-1] == {"text": "last", "keep": "row"}, seed
