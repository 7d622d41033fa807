"""``import sluice``: generate in-process and submit through the queue, on a DataFrame and on a
``datasets.Dataset``, against the tiny random Llama (the engine's own results are the reference)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow.parquet as pq
import pytest
from helpers import fresh_seed
from jobs_helpers import ThreadWorker
from sluice.jobs.datasets import Request, RowSpec, read_requests
from sluice.jobs.datasets.readers import open_data
from sluice.jobs.lines import parse_line

import sluice

pytest_plugins = ["jobs_fixtures", "s3_fixtures"]  # `r`: the test's own Valkey; `s3`: a real S3 server

WORDS = ["river", "lamp", "cloud", "stone", "seven", "blue", "quiet", "north"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Any:
    from sluice.engine.llm import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=16, kv_cache_memory=8 << 20)


def frame(rng: random.Random, n: int) -> pd.DataFrame:
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))) for _ in range(n)]
    texts[3] = None  # a row that cannot render: its error, the rest run
    return pd.DataFrame({"id": [f"q{i}" for i in range(n)], "text": texts, "max_tokens": [rng.randint(1, 6) for _ in range(n)],
                         "keep": [rng.random() for _ in range(n)]})


def reference(llm: Any, data: Any, spec: RowSpec, **defaults: Any) -> dict[str, str]:
    """What the engine itself answers for the same requests (greedy, one run): the completions the API
    must join to each row."""
    from sluice.jobs.schemas import SamplingParams
    from sluice.worker.convert import job_to_request

    jobs = [parse_line(i.line, i.row + 1, SamplingParams(**defaults)) for i in read_requests(open_data(data), spec)
            if isinstance(i, Request)]
    done = llm.generate([job_to_request(j, j.custom_id) for j in jobs])
    return {c.request_id: c.outputs[0].text for c in done}


def check(out: pd.DataFrame, df: pd.DataFrame, want: dict[str, str] | None) -> None:
    assert list(out["id"]) == list(df["id"])  # one row each, in order
    pd.testing.assert_frame_equal(out[list(df.columns)], df)  # source columns intact
    for _, row in out.iterrows():
        if pd.isna(row["text"]):
            assert row["error"]["code"] == "missing_value" and pd.isna(row["completion"])
            continue
        assert row["error"] is None and row["finish_reason"] in ("stop", "length")
        assert 1 <= row["usage"]["completion_tokens"] <= row["max_tokens"]  # the row's own max_tokens column
        if want is not None:
            assert row["completion"] == want[row["id"]]


def test_generate_in_process_on_a_dataframe(llm: Any) -> None:
    df = frame(random.Random(fresh_seed()), 20)
    spec = RowSpec(template="Say: {text}", id_column="id")
    out = sluice.generate(df, template="Say: {text}", id_column="id", llm=llm, progress=False, temperature=0)
    assert isinstance(out, pd.DataFrame)
    check(out, df, reference(llm, df, spec, temperature=0))


def test_generate_in_process_on_a_dataset_to_a_file_and_resume(llm: Any, tmp_path: Path) -> None:
    import datasets

    df = frame(random.Random(fresh_seed()), 12)
    ds = datasets.Dataset.from_pandas(df, preserve_index=False)
    out = sluice.generate(ds, prompt_column="text", id_column="id", llm=llm, progress=False)
    assert isinstance(out, datasets.Dataset) and out.num_rows == len(df)
    assert out["keep"] == list(df["keep"])
    target = tmp_path / "out.parquet"
    summary = sluice.generate(ds, prompt_column="text", id_column="id", llm=llm, progress=False, output=str(target))
    assert (summary.rows, summary.completed, summary.failed) == (12, 11, 1)
    assert pq.read_table(target).column("completion").to_pylist() == out["completion"]
    # A rerun with resume finds every row written and leaves the output as it was (no engine needed).
    before = pq.read_table(target)
    again = sluice.generate(ds, prompt_column="text", id_column="id", llm=object(), progress=False,
                            output=str(target), resume=True)
    assert again.rows == 12 and pq.read_table(target).equals(before)


def test_submit_through_the_queue_on_a_dataframe_and_a_dataset(r: Any, llm: Any) -> None:
    import datasets

    df = frame(random.Random(fresh_seed()), 16)
    batch = sluice.submit(df, model="tiny", template="Say: {text}", id_column="id", r=r)
    assert [e.row for e in batch.row_errors] == [3]
    worker = ThreadWorker(llm)
    try:
        status = batch.wait(timeout=120, progress=False)
        assert status.status == "completed" and status.counts.completed == 15
        assert len(list(batch.results())) == 15
        check(batch.to_pandas(progress=False), df, None)
        assert isinstance(batch.to_data(progress=False), pd.DataFrame)
        # Without a max_tokens column, the keyword default holds for every row.
        ds = datasets.Dataset.from_pandas(df.drop(columns=["max_tokens"]), preserve_index=False)
        b2 = sluice.submit(ds, model="tiny", prompt_column="text", id_column="id", r=r, max_tokens=2)
        out = b2.to_dataset(timeout=120, progress=False)
        assert out["id"] == list(df["id"]) and out["keep"] == list(df["keep"])
        tokens = [u["completion_tokens"] for u in out["usage"] if u is not None]
        assert len(tokens) == 15 and max(tokens) <= 2
    finally:
        worker.join()


def test_bad_options_are_clear(llm: Any) -> None:
    df = pd.DataFrame({"text": ["a"]})
    with pytest.raises(ValueError, match="temperature"):
        sluice.generate(df, prompt_column="text", llm=llm, temperature=-1)
    with pytest.raises(ValueError, match="no column 'body'"):
        sluice.generate(df, template="{body}", llm=llm)
    assert json.loads(json.dumps(sluice.__all__)) == ["Batch", "generate", "submit"]


# Paced (tests/support/paced.py): 750 steps, 15 s at the least, so the run is still going when the test kills it.
_KILLED_GENERATE = """
import sys
sys.path.insert(0, {root!r} + "/tests/support")  # the package itself is installed (sluice.*)
import paced
import sluice
paced.pace_every_engine()
sluice.generate({src!r}, prompt_column="text", id_column="id", model={model!r}, output={out!r}, progress=False,
                engine_options=dict(dtype="float32", max_num_seqs=4, kv_cache_memory=8 << 20), max_tokens=24)
"""


def test_generate_resumes_after_kill_9_with_every_row_exactly_once(llm: Any, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    import os
    import signal
    import sqlite3
    import subprocess
    import sys
    import time

    rng = random.Random(fresh_seed())
    df = frame(rng, 120).drop(columns=["max_tokens"])
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    df.to_parquet(src)
    root = Path(__file__).resolve().parents[2]
    script = _KILLED_GENERATE.format(root=str(root), src=str(src), model=str(tiny_model_dir), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    journal = Path(f"{out}.sluice-journal")
    deadline = time.monotonic() + 300
    kept: dict[str, Any] = {}
    while time.monotonic() < deadline and proc.poll() is None:
        if journal.exists():
            try:
                with sqlite3.connect(journal) as db:
                    if db.execute("SELECT COUNT(*) FROM results").fetchone()[0] >= 10:
                        os.kill(proc.pid, signal.SIGKILL)
                        break
            except sqlite3.OperationalError:
                pass  # the tables are being made
        time.sleep(0.05)
    assert proc.wait(60) == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    with sqlite3.connect(journal) as db:
        kept = {cid: json.loads(cols) for cid, cols in db.execute("SELECT custom_id, cols FROM results")}
    assert 10 <= len(kept) < 119, "the run was to be killed part-way"

    ran: list[str] = []

    class Counting:  # the engine, noting which requests the resumed run sends it
        def __getattr__(self, name: str) -> Any:
            return getattr(llm, name)

        def add_request(self, request: Any) -> None:
            ran.append(request.request_id)
            llm.add_request(request)

    summary = sluice.generate(str(src), prompt_column="text", id_column="id", llm=Counting(), output=str(out),
                              resume=True, progress=False, max_tokens=24)
    good = {i for i, t in zip(df["id"], df["text"], strict=True) if not pd.isna(t)}
    assert sorted(ran) == sorted(good - set(kept))  # the rest, each once; nothing the killed run finished
    table = pq.read_table(out).to_pandas()
    assert list(table["id"]) == list(df["id"])  # every row once, in order
    assert (summary.rows, summary.completed, summary.failed, summary.no_result) == (120, 119, 1, 0)
    for _, row in table.iterrows():
        if row["id"] in kept:  # what the killed run finished is kept, not generated again
            assert row["completion"] == kept[row["id"]]["completion"]
    assert not journal.exists()


def test_generate_feeds_the_engine_a_window_at_a_time(llm: Any) -> None:
    """The rows are read as the engine has room: never more than two requests per engine slot wait in
    it, so a large source is not turned into requests all at once."""
    from sluice.worker.runner import WINDOW_PER_SEQ

    df = frame(random.Random(fresh_seed()), 90).drop(columns=["max_tokens"])
    state = {"open": 0, "peak": 0}

    class Watching:
        def __getattr__(self, name: str) -> Any:
            return getattr(llm, name)

        def add_request(self, request: Any) -> None:
            state["open"] += 1
            state["peak"] = max(state["peak"], state["open"])
            llm.add_request(request)

        def step(self) -> Any:
            done = llm.step()
            state["open"] -= len(done)
            return done

    out = sluice.generate(df, prompt_column="text", llm=Watching(), progress=False, max_tokens=3)
    assert out["completion"].notna().sum() == 89 and state["open"] == 0
    assert state["peak"] == WINDOW_PER_SEQ * llm.config.max_num_seqs < 89


def test_generate_from_and_to_object_storage(s3: dict[str, Any], llm: Any, tmp_path: Path) -> None:
    df = frame(random.Random(fresh_seed()), 10).drop(columns=["max_tokens"])
    df.to_parquet(tmp_path / "in.parquet")
    s3["fs"].put(str(tmp_path / "in.parquet"), "s3://sluice-test/in.parquet")
    summary = sluice.generate("s3://sluice-test/in.parquet", prompt_column="text", id_column="id", llm=llm,
                              output="s3://sluice-test/out.parquet", storage_options=s3["opts"], progress=False,
                              max_tokens=3)
    assert (summary.rows, summary.completed, summary.failed) == (10, 9, 1)
    with s3["fs"].open("s3://sluice-test/out.parquet", "rb") as f:
        out = pq.read_table(f).to_pandas()
    assert list(out["id"]) == list(df["id"]) and list(out["keep"]) == list(df["keep"])
