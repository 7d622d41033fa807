"""Helpers of the dataset tests (tests/jobs/test_datasets_read.py, tests/jobs/test_datasets_write.py): random
rows, a source of each format built from them, fake engine results that depend on their request's
text (a result joined to the wrong row is caught), and the check that an output holds every source row
with its result."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
from sluice.jobs.datasets import Request, ResultsWriter, RowError, RowSpec, open_source, read_requests
from sluice.jobs.datasets.results import result_columns
from sluice.jobs.lines import parse_line
from sluice.jobs.schemas import Job

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

