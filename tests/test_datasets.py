"""Datasets in, datasets out (jobs/datasets): every input format read to request lines, every output
format written back with the source's columns kept, bounded memory on 200,000 rows, resume after a
kill -9, and object storage against a real S3-compatible server (moto's server mode, no mocks)."""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
from helpers import fresh_seed

from jobs.datasets import (
    MissingExtra,
    Request,
    ResultsWriter,
    RowError,
    RowSpec,
    SourceError,
    SpecError,
    open_data,
    open_source,
    read_requests,
)
from jobs.datasets.results import result_columns
from jobs.lines import parse_line
from jobs.schemas import Job

pytest_plugins = ["jobs_fixtures", "s3_fixtures"]  # `r`: the test's own Valkey; `s3`: a real S3 server

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["river", "lamp", "ünïcode", "{braces}", "quote\"d", "tab\there", "naïve", "42", "line\nbreak", "日本"]
SPEC = RowSpec(template="Summarise: {text}", system="Be brief.", id_column="id")


# ---- building inputs ------------------------------------------------------------------------------
def make_rows(rng: random.Random, n: int, *, nulls: bool = False) -> list[dict[str, Any]]:
    """Rows with an id, a text, per-row sampling columns and an extra column the requests do not use."""
    rows = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
        rows.append({"id": f"doc-{rng.randrange(10**9)}-{i}", "text": None if nulls and i % 7 == 3 else text,
                     "temperature": round(rng.random(), 3), "max_tokens": rng.randint(1, 64),
                     "score": rng.randint(-5, 5)})
    return rows


def write_source(rows: list[dict[str, Any]], fmt: str, dest: Path) -> str:
    """``rows`` as a ``fmt`` source under ``dest``; returns its path or URL."""
    dest.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    if fmt == "jsonl":
        p = dest / "in.jsonl"
        p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    elif fmt == "jsonl.gz":
        p = dest / "in.jsonl.gz"
        p.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    elif fmt == "parquet":
        p = dest / "in.parquet"
        pq.write_table(table, p, row_group_size=7)  # several row groups, none aligned with the reader's blocks
    elif fmt == "parquet-dir":
        p = dest / "parts"
        p.mkdir()
        half = len(rows) // 2
        pq.write_table(table.slice(0, half), p / "part-0.parquet")
        pq.write_table(table.slice(half), p / "part-1.parquet")
    elif fmt == "csv":
        p = dest / "in.csv"
        pa_csv.write_csv(table, p)
    elif fmt in ("saved", "saved-dict"):
        import datasets

        p = dest / "saved"
        ds = datasets.Dataset.from_list(rows)
        if fmt == "saved-dict":
            ds = datasets.DatasetDict({"train": ds, "test": ds.select(range(1))})
        ds.save_to_disk(str(p))
    elif fmt == "file-url":
        pq.write_table(table, dest / "in.parquet")
        return f"file://{dest / 'in.parquet'}"
    else:
        raise AssertionError(fmt)
    return str(p)


def job_of(line: str, row: int) -> Job:
    return parse_line(line, row + 1)


def expected_job(row: dict[str, Any]) -> dict[str, Any]:
    """What SPEC must make of a row, said independently of the renderer."""
    return {"custom_id": row["id"], "messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": f"Summarise: {row['text']}"}],
            "temperature": float(row["temperature"]), "max_tokens": int(row["max_tokens"])}


def fake_result(req: Request, rng: random.Random, fail: bool) -> dict[str, Any]:
    """An OpenAI batch output line for a request, as the engine's would be (the completion depends on the
    request's own text, so a result joined to the wrong row is caught)."""
    user = json.loads(req.line)["messages"][-1]["content"]
    if fail:
        return {"id": f"batch_req_{req.custom_id}", "custom_id": req.custom_id,
                "response": {"status_code": 500, "request_id": "x",
                             "body": {"error": {"message": f"boom {req.row}", "code": "engine_error"}}},
                "error": {"code": "engine_error", "message": f"boom {req.row}"}}
    words = len(user.split())
    body = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
            "content": user[::-1]}, "finish_reason": rng.choice(["stop", "length"])}],
            "usage": {"prompt_tokens": words, "completion_tokens": req.row, "total_tokens": words + req.row}}
    return {"id": f"batch_req_{req.custom_id}", "custom_id": req.custom_id,
            "response": {"status_code": 200, "request_id": "x", "body": body}, "error": None}


def read_output(path: str, fmt: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    src = open_source(path, format=fmt, storage_options=storage_options)
    return [r for b in src.blocks() for r in b.rows()]


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


# ---- outputs --------------------------------------------------------------------------------------
def run_writer(source: str, output: str, spec: RowSpec, rng: random.Random, *, fail_every: int = 5,
               **kw: Any) -> tuple[dict[str, dict[str, Any]], list[RowError]]:
    """Read the requests, answer them in a random order (every ``fail_every``-th fails), write."""
    items = list(read_requests(source, spec))
    errors = [i for i in items if isinstance(i, RowError)]
    reqs = [i for i in items if isinstance(i, Request)]
    fed = {r.custom_id: fake_result(r, rng, fail=r.row % fail_every == 1) for r in reqs}
    rng.shuffle(reqs)
    with ResultsWriter(output, source, spec, **kw) as w:
        for e in errors:
            w.add_error(e)
        for r in reqs:
            w.add(json.dumps(fed[r.custom_id]))
    return fed, errors


def check_output(out_rows: list[dict[str, Any]], src_rows: list[dict[str, Any] | None], fed: dict[str, Any],
                 errors: list[RowError], spec: RowSpec, *, as_text: bool = False, prefix: str = "") -> None:
    """Source columns intact, in order, one row each; every result in its row; errors in their column."""
    assert len(out_rows) == len(src_rows)
    bad = {e.row: e for e in errors}
    for n, (out, src) in enumerate(zip(out_rows, src_rows, strict=True)):
        for k, v in (src or {}).items():
            got = float(out[k]) if as_text and isinstance(v, float) else out[k]  # CSV writes 1.0 as 1
            want = (v if v is None or isinstance(v, float) else str(v)) if as_text else v
            assert got == want, (n, k)
        err = out[prefix + "error"]
        if isinstance(err, str):
            err = json.loads(err) if err else None
        cid = str(src[spec.id_column]) if spec.id_column else str(n)
        if n in bad:
            assert err == {"code": bad[n].code, "message": str(bad[n])}
            continue
        want = result_columns(fed[cid])
        if want["error"] is not None:
            assert err == want["error"] and not out[prefix + "completion"]
            continue
        assert err is None
        assert out[prefix + "completion"] == want["completion"]
        assert out[prefix + "finish_reason"] == want["finish_reason"]
        usage = out[prefix + "usage"]
        assert (json.loads(usage) if isinstance(usage, str) else usage) == want["usage"]


@pytest.mark.parametrize("out_fmt", ["parquet", "jsonl", "csv"])
@pytest.mark.parametrize("src_fmt", ["parquet", "jsonl", "csv", "saved"])
def test_outputs_keep_the_source_rows_and_add_one_result_each(src_fmt: str, out_fmt: str, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 101, nulls=True)
    src = write_source(rows, src_fmt, tmp_path / "src")
    spec = RowSpec(template="Summarise: {text}", id_column="id")
    out = str(tmp_path / f"out/result.{out_fmt}")
    fed, errors = run_writer(src, out, spec, rng, rows=16)
    assert {e.row for e in errors} == {i for i, r in enumerate(rows) if r["text"] is None}
    src_rows = [r for b in open_source(src).blocks() for r in b.rows()]  # as the source reads (CSV: text)
    check_output(read_output(out, out_fmt), src_rows, fed, errors, spec, as_text=out_fmt == "csv")
    assert not Path(f"{out}.sluice-journal").exists()  # a finished output leaves no journal
    if out_fmt == "parquet":
        assert pq.ParquetFile(out).metadata.num_row_groups == -(-len(rows) // 16)  # written a group at a time


def test_results_are_written_a_row_group_at_a_time_as_they_land(tmp_path: Path) -> None:
    rows = make_rows(random.Random(3), 40)
    src = write_source(rows, "parquet", tmp_path)
    spec = RowSpec(prompt_column="text")
    reqs = [i for i in read_requests(src, spec) if isinstance(i, Request)]
    out = tmp_path / "out.jsonl"
    w = ResultsWriter(str(out), src, spec, rows=10)
    rng = random.Random(4)
    for r in reversed(reqs[10:25]):  # rows 10-24 first: nothing is due yet (row 0's group waits)
        w.add(fake_result(r, rng, fail=False))
    assert w.written == 0 and not out.exists()
    for r in reqs[:10]:
        w.add(fake_result(r, rng, fail=False))
    assert w.written == 20  # rows 0-9 completed group 0, and group 1 (10-19) was already complete
    assert len(out.read_text().splitlines()) == 20
    summary = w.close()  # rows 25-39 never got a result
    assert (summary.rows, summary.completed, summary.no_result) == (40, 25, 15)
    last = [json.loads(x) for x in out.read_text().splitlines()][25:]
    assert {x["error"]["code"] for x in last} == {"no_result"}


def test_embeddings_land_as_a_float_vector_column(tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    rows = [{"text": f"t{i}"} for i in range(9)]
    src = write_source(rows, "parquet", tmp_path)
    spec = RowSpec(prompt_column="text", chat=False)
    vectors = {}
    with ResultsWriter(str(tmp_path / "emb.parquet"), src, spec, embeddings=True, rows=4) as w:
        for r in read_requests(src, spec):
            vectors[r.row] = [rng.uniform(-1, 1) for _ in range(8)]
            w.add({"custom_id": r.custom_id, "response": {"status_code": 200, "body": {
                "object": "list", "data": [{"object": "embedding", "index": 0, "embedding": vectors[r.row]}],
                "usage": {"prompt_tokens": 2, "total_tokens": 2}}}, "error": None})
    table = pq.read_table(tmp_path / "emb.parquet")
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    got = table.column("embedding").to_pylist()
    assert all(v == pytest.approx(vectors[i], rel=1e-6) for i, v in enumerate(got))
    assert table.column("text").to_pylist() == [r["text"] for r in rows]


def test_result_columns_that_clash_with_the_source_take_a_prefix(tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    rows = [{"prompt": f"p{i}", "completion": f"reference {i}"} for i in range(12)]
    src = write_source(rows, "parquet", tmp_path)
    with pytest.raises(SourceError, match="already has a column 'completion'.*prefix"):
        ResultsWriter(str(tmp_path / "o.parquet"), src, RowSpec())
    fed, errors = run_writer(src, str(tmp_path / "o.parquet"), RowSpec(), rng, prefix="gen_")
    out = read_output(str(tmp_path / "o.parquet"), "parquet")
    check_output(out, rows, fed, errors, RowSpec(), prefix="gen_")
    assert [o["completion"] for o in out] == [r["completion"] for r in rows]


# ---- resume ---------------------------------------------------------------------------------------
_KILLED_WRITER = """
import json, os, random, signal, sys
sys.path[:0] = [{root!r}, {tests!r}]
from test_datasets import fake_result
from jobs.datasets import ResultsWriter, RowError, RowSpec, read_requests
spec = RowSpec(template="Summarise: {{text}}", id_column="id")
items = list(read_requests({src!r}, spec))
reqs = [i for i in items if not isinstance(i, RowError)]
random.Random({seed}).shuffle(reqs)
w = ResultsWriter({out!r}, {src!r}, spec, rows=16)
for e in items:
    if isinstance(e, RowError):
        w.add_error(e)
for k, r in enumerate(reqs[:{stop}]):
    w.add(fake_result(r, random.Random(r.row), fail=r.row % 5 == 1))
    print(r.custom_id, flush=True)  # reported: a result the caller may count on
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_resume_after_kill_9_gives_every_row_exactly_once(tmp_path: Path) -> None:
    seed = fresh_seed()
    rows = make_rows(random.Random(seed), 150, nulls=True)
    src = write_source(rows, "parquet", tmp_path / "src")
    out = str(tmp_path / "out.parquet")
    script = _KILLED_WRITER.format(root=str(ROOT), tests=str(ROOT / "tests"), src=src, out=out, seed=seed, stop=90)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    reported = proc.stdout.split()
    assert len(reported) == 90
    with pytest.raises(Exception):  # noqa: B017 - a Parquet file cut by a kill has no footer
        pq.read_table(out)

    spec = RowSpec(template="Summarise: {text}", id_column="id")
    w = ResultsWriter(out, src, spec, resume=True, rows=16)
    assert all(w.done(c) for c in reported)  # every reported result survived the kill
    items = list(read_requests(src, spec, skip=w.done))
    again = [i for i in items if isinstance(i, Request)]
    answered = {i.custom_id for i in again}
    assert not answered & set(reported)
    assert answered | set(reported) == {r["id"] for r in rows if r["text"] is not None}  # the rest, once each
    fed = {}
    for r in again:
        fed[r.custom_id] = fake_result(r, random.Random(r.row), fail=r.row % 5 == 1)
        w.add(fed[r.custom_id])
    for e in items:
        if isinstance(e, RowError):
            w.add_error(e)
    w.close()
    for cid in reported:  # what the killed run produced, made again the same way for checking
        row = next(i for i, r in enumerate(rows) if r["id"] == cid)
        req = Request(row, cid, json.dumps({"messages": [{"role": "user", "content": f"Summarise: {rows[row]['text']}"}]}))
        fed[cid] = fake_result(req, random.Random(row), fail=row % 5 == 1)
    errors = [i for i in items if isinstance(i, RowError)]
    check_output(read_output(out, "parquet"), rows, fed, errors, spec)

    # A second resume of the finished output (no journal now) finds every row done and keeps it.
    before = pq.read_table(out)
    w = ResultsWriter(out, src, spec, resume=True, rows=16)
    assert not [i for i in read_requests(src, spec, skip=w.done) if isinstance(i, Request)]
    w.close()
    assert pq.read_table(out).equals(before)


def test_rows_left_without_a_result_run_again_on_resume(tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 30)
    src = write_source(rows, "parquet", tmp_path)
    spec = RowSpec(prompt_column="text")
    out = str(tmp_path / "out.jsonl")
    reqs = [i for i in read_requests(src, spec) if isinstance(i, Request)]
    with ResultsWriter(out, src, spec, rows=8) as w:
        for r in reqs[::2]:
            w.add(fake_result(r, rng, fail=False))
    assert w.summary.no_result == 15
    w = ResultsWriter(out, src, spec, resume=True, rows=8)
    todo = [i for i in read_requests(src, spec, skip=w.done) if isinstance(i, Request)]
    assert [r.row for r in todo] == list(range(1, 30, 2))
    for r in todo:
        w.add(fake_result(r, rng, fail=False))
    assert w.close().completed == 30


def test_the_output_cannot_be_the_source(tmp_path: Path) -> None:
    src = write_source(make_rows(random.Random(6), 10), "parquet", tmp_path)
    before = Path(src).read_bytes()
    for same in (src, f"file://{src}"):
        with pytest.raises(SourceError, match="is the source itself"):
            ResultsWriter(same, src, RowSpec(prompt_column="text"))
    assert Path(src).read_bytes() == before


def test_a_journal_of_another_run_is_refused(tmp_path: Path) -> None:
    src = write_source(make_rows(random.Random(5), 10), "parquet", tmp_path)
    out = str(tmp_path / "out.parquet")
    w = ResultsWriter(out, src, RowSpec(prompt_column="text"), rows=4)
    w.abort()
    with pytest.raises(SourceError, match="another run"):
        ResultsWriter(out, src, RowSpec(prompt_column="text", id_column="id"), resume=True)


# ---- memory ---------------------------------------------------------------------------------------
_STREAM_200K = """
import json, random, sys
sys.path.insert(0, {root!r})
from jobs.datasets import ResultsWriter, RowSpec, read_requests, Request
def mib(key):  # this process's own (ru_maxrss would carry the parent's peak across the exec)
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
spec = RowSpec(prompt_column="text")
w = ResultsWriter({out!r}, {src!r}, spec)  # opens the source, the journal and the first block
base = mib("VmRSS")
rng = random.Random({seed})
window, n, early = [], 0, None
def answer(window):
    rng.shuffle(window)  # results land out of order, as from an engine with requests in flight
    for r in window:
        text = json.loads(r.line)["messages"][0]["content"]
        w.add({{"custom_id": r.custom_id, "response": {{"status_code": 200, "body": {{"choices": [
            {{"message": {{"role": "assistant", "content": text[:64]}}, "finish_reason": "stop"}}]}}}}}})
for r in read_requests({src!r}, spec):
    assert isinstance(r, Request), r
    window.append(r); n += 1
    if len(window) == 3000:
        answer(window); window = []
    if n == 50_000:
        early = mib("VmHWM")
answer(window)
s = w.close()
print(json.dumps({{"rows": n, "written": s.rows, "base_mb": base, "early_mb": early, "peak_mb": mib("VmHWM")}}))
"""


def test_200k_row_parquet_streams_in_bounded_memory(tmp_path: Path) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    src, n, row_chars = tmp_path / "big.parquet", 200_000, 3000
    with pq.ParquetWriter(src, pa.schema([("text", pa.string()), ("k", pa.int64())])) as pw:
        for start in range(0, n, 10_000):  # built a part at a time: the test holds no more than the code may
            # A random token repeated: large in memory, small on disk (the file compresses).
            texts = [rng.randbytes(15).hex() * (row_chars // 30) for _ in range(10_000)]
            pw.write_table(pa.table({"text": texts, "k": list(range(start, start + 10_000))}))
    data_mb = n * row_chars / 2**20
    out = tmp_path / "big.out.parquet"
    script = _STREAM_200K.format(root=str(ROOT), src=str(src), out=str(out), seed=seed)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"200,000 rows, {data_mb:.0f} MiB of text: RSS {got['base_mb']:.0f} MiB after imports and opening, "
          f"peak {got['early_mb']:.0f} MiB by row 50,000 and {got['peak_mb']:.0f} MiB by the end")
    assert got["rows"] == got["written"] == n
    # Holding the input (or the output) whole would take at least data_mb more; a block at a time takes
    # a fixed amount (measured: ~190 MiB, most of it pyarrow's Parquet reader itself, which costs about
    # as much iterating the file bare), reached early and not outgrown by the next 150,000 rows.
    assert got["peak_mb"] - got["base_mb"] < data_mb / 2, got
    assert got["peak_mb"] - got["early_mb"] < data_mb / 10, got
    meta = pq.ParquetFile(out).metadata
    assert meta.num_rows == n and meta.num_row_groups == -(-n // 4096)
    for batch in pq.ParquetFile(out).iter_batches(batch_size=20_000, columns=["text", "k", "completion"]):
        d = batch.to_pydict()
        assert d["completion"] == [t[:64] for t in d["text"]]
        assert d["k"] == list(range(d["k"][0], d["k"][0] + len(d["k"])))


# ---- object storage -------------------------------------------------------------------------------
@pytest.mark.parametrize("src_fmt,out_fmt", [("parquet", "parquet"), ("csv", "jsonl"), ("jsonl", "csv")])
def test_object_storage_input_and_output(s3: dict[str, Any], src_fmt: str, out_fmt: str, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 77, nulls=True)
    local = write_source(rows, src_fmt, tmp_path / "src")
    fs, opts = s3["fs"], s3["opts"]
    url = f"s3://sluice-test/in/{Path(local).name}"
    fs.put(local, url)
    source = open_source(url, storage_options=opts)
    spec = RowSpec(template="Summarise: {text}", id_column="id")
    out = f"s3://sluice-test/out/result.{out_fmt}"
    fed, errors = run_writer(source, out, spec, rng, storage_options=opts, rows=20)
    assert fs.exists(out)
    src_rows = [r for b in source.blocks() for r in b.rows()]
    assert src_rows == [r for b in open_source(local).blocks() for r in b.rows()]  # read from S3 as from disk
    check_output(read_output(out, out_fmt, opts), src_rows, fed, errors, spec, as_text=out_fmt == "csv")
    assert not list((tmp_path / "cache").rglob("*.sqlite"))  # the remote output's journal is gone once done


def test_object_storage_saved_dataset_and_resume_from_an_s3_output(s3: dict[str, Any], tmp_path: Path) -> None:
    import datasets

    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 25)
    opts = s3["opts"]
    datasets.Dataset.from_list(rows).save_to_disk("s3://sluice-test/saved", storage_options=opts)
    source = open_source("s3://sluice-test/saved", storage_options=opts)
    assert source.format == "saved"
    spec = RowSpec(template="Summarise: {text}", id_column="id")
    out = "s3://sluice-test/out/saved.parquet"
    fed, errors = run_writer(source, out, spec, rng, storage_options=opts, rows=10)
    check_output(read_output(out, "parquet", opts), rows, fed, errors, spec)
    w = ResultsWriter(out, source, spec, resume=True, storage_options=opts)
    assert all(w.done(r["id"]) for r in rows)  # read back from the finished output on S3
    w.abort()


# ---- the seam, extras, and the job plane's rule -------------------------------------------------
def test_rows_submit_to_the_queue_as_lines(r: Any, tmp_path: Path) -> None:
    """The lines go into jobs.submit.submit as a file's would; a bad row stays a blank line, so the
    batch's line numbers are row numbers + 1."""
    from jobs.submit import submit

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
    p = _run("import sys; sys.modules['pyarrow'] = None; import jobs.datasets")
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "jobs.datasets.extras.MissingExtra: this needs pyarrow, which is not installed: pip install 'sluice-llm[datasets]'")
    p = _run("""
        import sys; sys.modules['s3fs'] = None
        from jobs.datasets import MissingExtra, open_source
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
        from jobs.datasets import ResultsWriter, RowSpec, read_requests
        list(read_requests({src!r}, RowSpec(prompt_column="text")))
        print(sorted({{'torch', 'engine', 'worker'}} & set(sys.modules)))
        """)
    assert p.stdout.strip() == "[]", p.stderr
