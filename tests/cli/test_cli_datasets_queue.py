"""`sluice submit` and `sluice results` on datasets, on a real embedded job server with a tiny-model
worker: rows queued as requests, results joined back to the rows (the batch remembers its source and
row flags), --wait writing the joined rows as they land, object storage in and out, and the usage
errors of a join with nothing to join to."""

from __future__ import annotations

import http.server
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import pytest
from cli_api_helpers import sluice_home, tiny_worker
from click.testing import CliRunner, Result
from helpers import fresh_seed
from sluice.cli.common import EXIT_SOME_FAILED, EXIT_USAGE
from sluice.cli.main import cli
from sluice.jobs.datasets import open_source

pytest_plugins = ["s3_fixtures"]  # `s3`: a real S3-compatible server (moto's server mode)

WORDS = ["river", "lamp", "cloud", "stone", "seven", "blue", "quiet", "north"]


@pytest.fixture(scope="module")
def busy(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A home with a tiny-model worker serving the queue "tiny"."""
    with sluice_home(tmp_path_factory.mktemp("dsq") / "home") as h, tiny_worker(tiny_model_dir, queue="tiny"):
        yield h


def invoke(*args: str | Path) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


def make_rows(rng: random.Random, n: int, bad: int) -> list[dict[str, Any]]:
    return [{"id": f"q{i}-{rng.randrange(10**6)}",
             "text": None if i == bad else " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))),
             "keep": rng.random()} for i in range(n)]


def rows_of(url: str, **kw: Any) -> list[dict[str, Any]]:
    return [r for b in open_source(url, **kw).blocks() for r in b.rows()]


def answers(bid: str) -> dict[str, str]:
    """The batch's own result lines (`sluice results BID` to stdout), content by custom_id."""
    res = invoke("results", bid)
    assert res.exit_code == 0, res.output
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    return {x["custom_id"]: x["response"]["body"]["choices"][0]["message"]["content"] for x in lines}


def check_joined(out: list[dict[str, Any]], rows: list[dict[str, Any]], want: dict[str, str], bad: int,
                 as_text: bool = False) -> None:
    assert len(out) == len(rows)
    for n, (o, s) in enumerate(zip(out, rows, strict=True)):
        assert {k: o[k] for k in s} == s, n  # source columns intact, in order
        error = json.loads(o["error"]) if as_text and o["error"] else o["error"]
        if n == bad:
            assert error == {"code": "missing_value", "message": f"row {n}: column 'text' is empty (null)"}
        else:
            assert error is None and o["completion"] == want[s["id"]], (n, o)


def test_submit_a_parquet_file_then_join_its_results(busy: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 17
    bad = rng.randrange(n)
    rows = make_rows(rng, n, bad)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src, row_group_size=4)
    res = invoke("submit", src, "--model", "tiny", "--prompt-column", "text", "--id-column", "id",
                 "--max-tokens", "3")
    assert res.exit_code == EXIT_SOME_FAILED, res.output  # the row that did not render
    assert f"1 rows not queued, first row {bad}: column 'text' is empty (null)" in res.stderr
    bid = res.stdout.strip()
    out = tmp_path / "joined.parquet"
    # The batch names its source and row flags: nothing to repeat here.
    res = invoke("results", bid, "-o", out, "--follow", "--no-progress")
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    assert f"completed: {n} rows: {n - 1} completed, 1 failed" in res.stderr
    check_joined(rows_of(str(out)), rows, answers(bid), bad)

    # The source moved: --source says where; --output-format for a name that says none.
    moved = tmp_path / "moved.parquet"
    src.rename(moved)
    res = invoke("results", bid, "-o", out, "--no-progress")
    assert res.exit_code == 1 and "no such file" in res.stderr
    again = tmp_path / "joined.data"
    res = invoke("results", bid, "-o", again, "--source", moved, "--output-format", "csv")
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    check_joined(rows_of(str(again), format="csv"), [{k: _text(v) for k, v in r.items()} for r in rows],
                 answers(bid), bad, as_text=True)


def _text(v: Any) -> str | None:
    return None if v is None else str(v)


def test_submit_wait_writes_the_rows_as_they_land(busy: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 11, bad=4)
    src = tmp_path / "in.csv"
    pa_csv.write_csv(pa.Table.from_pylist(rows), src)
    res = invoke("submit", src, "--model", "tiny", "--template", "Say: {text}", "--wait", "--max-tokens", "2")
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    bid = res.stdout.strip()
    out = tmp_path / "in.results.csv"  # the default: beside the input, its format
    src_rows = rows_of(str(src))
    want = answers(bid)
    got = rows_of(str(out), format="csv")
    assert [r["id"] for r in got] == [r["id"] for r in src_rows]
    for n, (o, s) in enumerate(zip(got, src_rows, strict=True)):
        assert {k: o[k] for k in s} == s
        if n == 4:
            assert json.loads(o["error"])["message"] == "row 4: column 'text' is empty (null)"
        else:
            assert o["error"] is None and o["completion"] == want[str(n)]  # ids: row numbers


def test_object_storage_in_and_out(busy: Path, s3: dict[str, Any], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3["opts"]["endpoint_url"])  # how a user points s3fs at a store
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client would know another endpoint
    rng = random.Random(fresh_seed())
    rows = make_rows(rng, 9, bad=2)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    s3["fs"].put(str(tmp_path / "in.parquet"), "s3://sluice-test/in.parquet")
    res = invoke("submit", "s3://sluice-test/in.parquet", "--model", "tiny", "--prompt-column", "text",
                 "--id-column", "id", "--max-tokens", "2")
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    bid = res.stdout.strip()
    res = invoke("results", bid, "-o", "s3://sluice-test/out/joined.parquet", "--follow", "--no-progress")
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    with s3["fs"].open("s3://sluice-test/out/joined.parquet", "rb") as f:
        out = pq.read_table(f).to_pylist()
    check_joined(out, rows, answers(bid), 2)
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_join_needs_rows_to_join_to(busy: Path, tmp_path: Path) -> None:
    src = tmp_path / "lines.jsonl"
    src.write_text('{"custom_id": "a", "prompt": "hi", "max_tokens": 2}\n')
    res = invoke("submit", src, "--model", "tiny")
    assert res.exit_code == 0, res.output
    bid = res.stdout.strip()
    res = invoke("results", bid, "-o", tmp_path / "out.parquet")
    assert res.exit_code == EXIT_USAGE
    assert res.stderr.strip() == (f"Error: batch {bid} was not submitted from a dataset: give --source, the rows "
                                  "to join its results to")
    res = invoke("submit", tmp_path / "in.parquet", "--model", "tiny", "--prompt-column", "text",
                 "--template", "{text}")
    assert res.exit_code == EXIT_USAGE and "give one of" in res.stderr


# ---- issue 40, item 1: a client's batch metadata never steers the operator's CLI ------------------
EVIL = ("{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}"
        "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ text }}")


class _Counting(http.server.BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        body = b"text\nhello\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:  # noqa: N802
        self.hits.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def web() -> Iterator[tuple[str, list[str]]]:
    """An HTTP server that serves a CSV and counts every request it gets."""
    _Counting.hits = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", _Counting.hits
    finally:
        srv.shutdown()
        t.join()


def _evil_template(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "marker"
    template = tmp_path / "evil.j2"
    template.write_text(EVIL.replace("MARKER", str(marker)))
    return template, marker


def test_the_api_refuses_sluices_own_metadata_keys(busy: Path, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient
    from sluice.api.app import create_app
    from sluice.api.settings import Settings
    from sluice.jobs import keys
    from sluice.jobs.connection import connect

    r = connect()
    api = TestClient(create_app(Settings(api_key=None, files_dir=tmp_path / "files")))
    f = api.post("/v1/files", files={"file": ("in.jsonl", b'{"custom_id": "a", "prompt": "hi", "max_tokens": 2}\n')},
                 data={"purpose": "batch"})
    assert f.status_code == 200, f.text
    before = r.zcard(keys.all_batches())
    for key in ("sluice_source", "sluice_rows", "SLUICE_anything"):
        got = api.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions",
                                            "metadata": {"note": "x", key: "/etc/passwd"}})
        assert got.status_code == 400, got.text
        err = got.json()["error"]
        assert err["code"] == "invalid_metadata" and err["param"] == "metadata" and repr(key) in err["message"]
    assert r.zcard(keys.all_batches()) == before  # nothing was made of them
    ok = api.post("/v1/batches", json={"input_file_id": f.json()["id"], "endpoint": "/v1/completions",
                                       "metadata": {"source": "mine"}})
    assert ok.status_code == 200 and ok.json()["metadata"] == {"source": "mine"}, ok.text
    assert r.zcard(keys.all_batches()) == before + 1


def test_results_never_trust_a_batchs_metadata(busy: Path, tmp_path: Path, web: tuple[str, list[str]]) -> None:
    """A batch whose metadata names a source and row flags the way an older ``sluice submit`` did (put
    there straight in Redis: an older server let a client write them): ``sluice results`` opens no URL,
    reads no local file and renders no template of theirs."""
    from sluice.jobs import keys
    from sluice.jobs.connection import connect

    url, hits = web
    template, marker = _evil_template(tmp_path)
    secret = tmp_path / "secret.csv"
    secret.write_text("text\nthe operator's secret\n")
    src = tmp_path / "lines.jsonl"
    src.write_text('{"custom_id": "0", "prompt": "hi", "max_tokens": 2}\n')
    res = invoke("submit", src, "--model", "tiny", "--wait", "-o", tmp_path / "lines.out.jsonl")
    assert res.exit_code == 0, res.output
    bid = res.stdout.strip()
    r = connect()
    assert r.hget(keys.meta(bid), "dataset") is None  # JSONL lines: no dataset of the CLI's own

    rows = json.dumps({"template_file": str(template)})
    for planted in (f"{url}/rows.csv", str(secret)):
        r.hset(keys.meta(bid), "metadata", json.dumps({"sluice_source": planted, "sluice_rows": rows}))
        out = tmp_path / "out.parquet"
        res = invoke("results", bid, "-o", out)
        assert res.exit_code == EXIT_USAGE, res.output
        assert f"batch {bid} was not submitted from a dataset: give --source" in res.stderr
        assert not out.exists()
    # With --source the operator names the rows; the planted row flags are still not read.
    mine = tmp_path / "mine.csv"
    mine.write_text("prompt\nhi\n")
    res = invoke("results", bid, "-o", tmp_path / "joined.jsonl", "--source", mine)
    assert res.exit_code == 0, res.output
    (joined,) = rows_of(str(tmp_path / "joined.jsonl"))
    assert joined["prompt"] == "hi" and joined["error"] is None and isinstance(joined["completion"], str)
    assert hits == [] and not marker.exists()
    assert "secret" not in (tmp_path / "joined.jsonl").read_text()


def test_a_template_that_reaches_for_python_fails_each_row(busy: Path, tmp_path: Path) -> None:
    """Jinja templates render sandboxed: reaching for the interpreter's insides is each row's own clear
    error, and nothing of it runs."""
    template, marker = _evil_template(tmp_path)
    src = tmp_path / "in.csv"
    src.write_text("text\none\ntwo\nthree\n")
    out = tmp_path / "out.jsonl"
    res = invoke("submit", src, "--model", "tiny", "--template-file", template, "--wait", "-o", out)
    assert res.exit_code == 1, res.output
    assert "no valid requests" in res.stderr and "the template is refused: access to attribute" in res.stderr
    assert not marker.exists() and not out.exists()
    from sluice.jobs.datasets import read_requests
    from sluice.jobs.datasets.rows import RowSpec

    got = list(read_requests(str(src), RowSpec(template_file=str(template))))
    assert [(e.row, e.code) for e in got] == [(0, "unsafe_template"), (1, "unsafe_template"), (2, "unsafe_template")]
    assert all("is unsafe" in str(e) for e in got)
    assert not marker.exists()
