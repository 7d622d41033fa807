"""Datasets out (jobs/datasets): every output format written back with the source's columns kept and
one result per row, a row group at a time as results land, resume after a kill -9, bounded memory on
200,000 rows, and object storage against a real S3-compatible server (moto's server mode, no mocks)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from dataset_helpers import check_output, fake_result, make_rows, read_output, run_writer, write_source
from helpers import fresh_seed
from sluice.jobs.datasets import (
    Request,
    ResultsWriter,
    RowError,
    RowSpec,
    SourceError,
    open_source,
    read_requests,
)

pytest_plugins = ["s3_fixtures"]  # `s3`: a real S3-compatible server

ROOT = Path(__file__).resolve().parents[2]


# ---- outputs --------------------------------------------------------------------------------------

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
sys.path.insert(0, {tests!r})  # the package itself is installed (sluice.*)
from dataset_helpers import fake_result
from sluice.jobs.datasets import ResultsWriter, RowError, RowSpec, read_requests
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
    script = _KILLED_WRITER.format(root=str(ROOT), tests=str(ROOT / "tests" / "support"), src=src, out=out, seed=seed, stop=90)
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


@pytest.mark.parametrize("out_fmt", ["parquet", "jsonl", "csv"])
@pytest.mark.parametrize("src_fmt", ["parquet", "jsonl", "csv"])
def test_resume_refuses_another_sources_output(src_fmt: str, out_fmt: str, tmp_path: Path) -> None:
    """Issue 40, item 8: rows are found by id (here the row number, which every source has), so the
    output of another source would pass for done. Its rows are checked against the source's: another
    source's output is refused, untouched; the same rows moved elsewhere, or with rows added, resume."""
    seed = fresh_seed()
    rng = random.Random(seed)
    rows = make_rows(rng, 30, nulls=True)
    a = write_source(rows, src_fmt, tmp_path / "a")
    spec = RowSpec(template="Summarise: {text}")
    out = str(tmp_path / f"out.{out_fmt}")
    run_writer(a, out, spec, rng)
    before = Path(out).read_bytes()

    other = [dict(r) for r in rows]
    k = rng.randrange(len(other))
    other[k]["score"] = 1000 + rng.randrange(1000)  # one value of one column no request reads
    b = write_source(other, src_fmt, tmp_path / "b")
    with pytest.raises(SourceError) as e:
        ResultsWriter(out, b, spec, resume=True, rows=8)
    assert str(e.value) == (f"cannot resume: {out} is not the output of {b} (its row {k}: the source holds another "
                            "row there); start without --resume, or resume with the source it was made from"), seed
    longer = write_source(rows[:10], src_fmt, tmp_path / "short")  # the output has rows its source lacks
    with pytest.raises(SourceError, match=r"\(its row 10: the source has no such row\)"):
        ResultsWriter(out, longer, spec, resume=True, rows=8)
    assert Path(out).read_bytes() == before, seed
    assert not list(tmp_path.glob("*.sluice-journal*")), seed  # a refused resume leaves no journal either

    moved = tmp_path / "moved"
    Path(a).rename(moved.with_suffix(Path(a).suffix))
    w = ResultsWriter(out, str(moved.with_suffix(Path(a).suffix)), spec, resume=True, rows=8)
    assert all(w.done(str(i)) for i in range(len(rows)) if rows[i]["text"] is not None), seed
    w.abort()
    w.journal.remove()  # as if that run had ended
    grown = write_source([*rows, *make_rows(rng, 5)], src_fmt, tmp_path / "grown")
    w = ResultsWriter(out, grown, spec, resume=True, rows=8)
    todo = [i.row for i in read_requests(grown, spec, skip=w.done) if isinstance(i, Request)]
    assert todo[-5:] == list(range(30, 35)) and not [r for r in todo if r < 30 and rows[r]["text"] is not None]
    w.abort()


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
# the package itself is installed (sluice.*)
from sluice.jobs.datasets import ResultsWriter, RowSpec, read_requests, Request
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
