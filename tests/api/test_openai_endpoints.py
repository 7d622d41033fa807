"""``/v1/chat/completions`` and ``/v1/completions`` on the queue, driven by the unmodified ``openai`` SDK
(sync and async, streamed and not) against a live ``sluice serve`` and workers on the tiny model: every
answer is the engine's own (greedy, checked against an in-process engine on the same weights) and comes
once; a worker killed with -9 mid-run: non-streamed requests are re-run by another worker, streams end
with an error event; bad input, 429 past the bound, 504 past the timeout, a client that goes away."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from cli_api_helpers import WORDS, sluice_home, start_sluice, stop, wait_for_url
from held_engine import HeldLLM
from helpers import fresh_seed
from jobs_helpers import ThreadWorker, wait_for, worker_process
from sluice.jobs import keys
from sluice.jobs.connection import connect

KEY = "sk-sluice-test"


@dataclass
class Live:
    url: str
    home: Path
    worker: ThreadWorker
    llm: HeldLLM

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120, **kw)

    def aclient(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=300)


def _serve(home: Path, **env: str) -> tuple[Any, str]:
    log = home.parent / f"serve-{time.monotonic_ns()}.log"
    proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log,
                        env={**os.environ, "SLUICE_API_KEY": KEY, **env})
    return proc, wait_for_url(proc, log, timeout=60)


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    home = tmp_path_factory.mktemp("openai") / "home"
    with sluice_home(home):
        llm = HeldLLM(str(tiny_model_dir), dtype="float32", max_num_seqs=16, kv_cache_memory=8 << 20)
        w = ThreadWorker(llm, queue="tiny")
        proc, url = _serve(home)
        try:
            yield Live(url, home, w, llm)
        finally:
            assert stop(proc) == 0
            w.join()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    """An in-process engine on the same weights: the answers to expect."""
    from sluice.engine.llm import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=16, kv_cache_memory=8 << 20)


def _expected(llm: Any, reqs: list[dict[str, Any]]) -> list[str]:
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

    todo = []
    for i, q in enumerate(reqs):
        params = SamplingParams(max_tokens=q["max_tokens"], temperature=0.0, ignore_eos=q.get("ignore_eos", False))
        kw = {"messages": q["messages"]} if "messages" in q else {"prompt": q["prompt"]}
        todo.append(Request(f"ref-{i}", params=params, **kw))
    return [c.text for c in llm.generate(todo)]


def _requests(rng: random.Random, n: int) -> list[dict[str, Any]]:
    reqs = []
    for _ in range(n):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        q: dict[str, Any] = {"max_tokens": rng.randint(1, 8), "stream": rng.random() < 0.5}
        if rng.random() < 0.5:
            q["messages"] = [{"role": "user", "content": words}]
        else:
            q["prompt"] = words
        reqs.append(q)
    return reqs


def _streamed_text(chunks: list[Any], chat: bool) -> str:
    if chat:
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def _sync_call(client: openai.OpenAI, q: dict[str, Any]) -> str:
    chat = "messages" in q
    kw = {**{k: v for k, v in q.items() if k != "ignore_eos"}, "model": "tiny", "temperature": 0,
          "extra_body": {"ignore_eos": q.get("ignore_eos", False)}}
    if chat:
        if q["stream"]:
            return _streamed_text(list(client.chat.completions.create(**kw)), True)
        return client.chat.completions.create(**kw).choices[0].message.content or ""
    if q["stream"]:
        return _streamed_text(list(client.completions.create(**kw)), False)
    return client.completions.create(**kw).choices[0].text


async def _async_call(client: openai.AsyncOpenAI, q: dict[str, Any]) -> str:
    chat = "messages" in q
    kw = {**{k: v for k, v in q.items() if k != "ignore_eos"}, "model": "tiny", "temperature": 0,
          "extra_body": {"ignore_eos": q.get("ignore_eos", False)}}
    if chat:
        if q["stream"]:
            return _streamed_text([c async for c in await client.chat.completions.create(**kw)], True)
        return (await client.chat.completions.create(**kw)).choices[0].message.content or ""
    if q["stream"]:
        return _streamed_text([c async for c in await client.completions.create(**kw)], False)
    return (await client.completions.create(**kw)).choices[0].text


def _left_behind(home: Path) -> list[str]:
    r = connect()
    return [k for k in r.scan_iter(match=f"{keys.PREFIX}:*{{req_*")] + list(r.zrange(keys.interactive("tiny"), 0, -1))


def test_sync_sdk_streamed_and_not_and_response_shapes(live: Live, reference: Any) -> None:
    rng = random.Random(fresh_seed())
    reqs = _requests(rng, 8)
    reqs[0]["stream"], reqs[1]["stream"] = True, False
    client = live.client()
    got = [_sync_call(client, q) for q in reqs]
    assert got == _expected(reference, reqs)

    full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "river gate"}],
                                          max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert full.object == "chat.completion" and full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 3 and full.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "river gate"}],
                                                 max_tokens=3, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    assert _left_behind(live.home) == []


def test_two_hundred_concurrent_async_requests_each_answered_once(live: Live, reference: Any) -> None:
    rng = random.Random(fresh_seed())
    reqs = _requests(rng, 200)
    before = live.worker.worker.session.stats.completed

    async def run() -> list[str]:
        client = live.aclient()
        try:
            return list(await asyncio.gather(*(_async_call(client, q) for q in reqs)))
        finally:
            await client.close()

    got = asyncio.run(run())
    assert got == _expected(reference, reqs)
    wait_for(lambda: live.worker.worker.session.stats.completed - before >= 200, 30, "outcomes written")
    assert live.worker.worker.session.stats.completed - before == 200  # each job ran once
    assert _left_behind(live.home) == []


def test_bad_input_is_a_400_in_openais_shape(live: Live) -> None:
    client = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    assert "messages[0] needs a role" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    assert "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="nope", prompt="x")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong", max_retries=0).completions.create(
            model="tiny", prompt="x")


def test_metrics_count_latency_and_time_to_first_token(live: Live) -> None:
    client = live.client()
    list(client.completions.create(model="tiny", prompt="mill wheel", max_tokens=2, stream=True))
    text = httpx.get(f"{live.url}/metrics").text
    assert 'sluice_api_request_latency_seconds_count{endpoint="/v1/completions",status="200",stream="true"}' in text
    assert 'sluice_api_time_to_first_token_seconds_count{endpoint="/v1/completions"}' in text


def _answered_with(live: Live, status: str) -> float:
    """How many /v1/completions answers with ``status`` the API has counted (its latency histogram)."""
    text = httpx.get(f"{live.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("sluice_api_request_latency_seconds_count") and f'status="{status}"' in line)


def test_a_client_that_goes_away_cancels_its_job(live: Live) -> None:
    r = connect()
    body = {"model": "tiny", "prompt": "weir canal", "max_tokens": 4000, "ignore_eos": True}
    gone_before = _answered_with(live, "499")
    # The engine is held while the client waits and leaves: the request cannot finish first, however fast
    # this machine is.
    with live.llm.held():
        with httpx.Client(base_url=live.url, headers={"Authorization": f"Bearer {KEY}"}) as http:
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body, timeout=1.5)
        wait_for(lambda: _answered_with(live, "499") > gone_before, 30, "the API to see the client go")
    wait_for(lambda: not _left_behind(live.home), 30, "the abandoned request's keys to go")
    assert not r.zcard(keys.interactive("tiny"))
    # The API deletes the keys itself; the worker learns of the cancel from its feed and aborts the run.
    wait_for(lambda: live.llm.aborted, 30, "the worker to abort the abandoned request in its engine")


def test_timeout_is_504_and_the_bound_is_429(live: Live) -> None:
    proc, url = _serve(live.home, SLUICE_INTERACTIVE_TIMEOUT="1", SLUICE_INTERACTIVE_MAX_WAITING="1")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
        with live.llm.held(), pytest.raises(openai.APIStatusError) as e:  # no answer can come in time
            client.completions.create(model="tiny", prompt="stone bank", max_tokens=4000,
                                      extra_body={"ignore_eos": True})
        assert e.value.status_code == 504 and e.value.code == "timeout"
        r = connect()
        r.zadd(keys.interactive("tiny"), {"req_someone_else": time.time()})  # one request waiting already
        try:
            with pytest.raises(openai.RateLimitError) as rl:
                client.completions.create(model="tiny", prompt="stone bank", max_tokens=1)
            assert rl.value.response.headers["retry-after"] == "1"
        finally:
            r.zrem(keys.interactive("tiny"), "req_someone_else")
        assert client.completions.create(model="tiny", prompt="stone bank", max_tokens=1).choices[0].text is not None
    finally:
        assert stop(proc) == 0
    wait_for(lambda: not _left_behind(live.home), 10, "the timed-out request's keys to go")


def test_worker_killed_mid_run(tiny_model_dir: Path, tmp_path: Path, reference: Any) -> None:
    """Worker A is killed with -9 while it runs every request; worker B, started then, re-runs the
    non-streamed ones (after A's heartbeat lapses); the streams that had text end with an error event."""
    rng = random.Random(fresh_seed())
    home = tmp_path / "home"
    with sluice_home(home):
        a = worker_process(tiny_model_dir, "worker-a", "--max-num-seqs", "32", log=tmp_path / "a.log")
        proc, url = _serve(home)
        b = None
        try:
            r = connect()
            wait_for(lambda: r.exists(keys.heartbeat("worker-a")), 120, "worker a")
            plain = [{"messages": [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(4))}],
                      "max_tokens": 1500, "ignore_eos": True, "stream": False} for _ in range(6)]
            streams = [{"prompt": " ".join(rng.choice(WORDS) for _ in range(4)), "max_tokens": 3000,
                        "ignore_eos": True, "stream": True} for _ in range(3)]
            started: set[int] = set()

            killed_at: list[float] = []
            answered_at: list[float] = []

            async def plain_call(client: openai.AsyncOpenAI, q: dict[str, Any]) -> str:
                text = await _async_call(client, q)
                answered_at.append(time.monotonic())
                return text

            async def stream_call(client: openai.AsyncOpenAI, q: dict[str, Any]) -> str | Exception:
                kw = {k: v for k, v in q.items() if k != "ignore_eos"}
                try:
                    text = ""
                    async for c in await client.completions.create(model="tiny", temperature=0,
                                                                   extra_body={"ignore_eos": True}, **kw):
                        text += c.choices[0].text if c.choices else ""
                        if text:
                            started.add(id(q))
                    return text
                except openai.APIError as e:
                    return e

            async def killer() -> Any:
                while len(started) < len(streams):
                    await asyncio.sleep(0.02)
                os.kill(a.pid, signal.SIGKILL)
                killed_at.append(time.monotonic())
                return worker_process(tiny_model_dir, "worker-b", log=tmp_path / "b.log")

            async def run() -> tuple[list[Any], Any]:
                # A give-up limit only: on a loaded 2-core machine worker b's re-runs took over 300 s.
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=900)
                try:
                    calls = [stream_call(client, q) for q in streams] + [plain_call(client, q) for q in plain]
                    *got, b_proc = await asyncio.gather(*calls, killer())
                    return got, b_proc
                finally:
                    await client.close()

            got, b = asyncio.run(run())
            stream_out, plain_out = got[:len(streams)], got[len(streams):]
            assert plain_out == _expected(reference, plain)
            assert min(answered_at) > killed_at[0]  # none had finished on a: each was re-run by b
            for out in stream_out:
                assert isinstance(out, openai.APIError), out
                assert "worker" in out.message
        finally:
            for p in (a, b):
                if p is not None and p.poll() is None:
                    p.send_signal(signal.SIGTERM)
                    p.wait(60)
            assert stop(proc) == 0


def test_streamed_pieces_add_up_to_the_final_text(reference: Any) -> None:
    """worker/streaming.py on the engine itself: the pieces of each sample are a prefix of its final text
    (the rest comes with the result), and never run past where a stop string cuts it."""
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams
    from sluice.jobs.consumer.commands import Delivery
    from sluice.jobs.schemas import Job
    from sluice.jobs.schemas import SamplingParams as JobParams
    from sluice.worker.streaming import TextStreams

    rng = random.Random(fresh_seed())
    streams = TextStreams(reference.tokenizer)
    sent: dict[str, str] = {}
    final: dict[str, str] = {}
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(6)]
    # A stop string that does occur: three characters of what each prompt generates.
    peeks = reference.generate([Request(f"peek{i}", prompt=p, params=SamplingParams(max_tokens=12, ignore_eos=True))
                                for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        stop = [peeks[i].text[5:8]] if i % 2 and peeks[i].text[5:8] else []
        params = SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=True, stop=stop)
        reference.add_request(Request(f"s{i}", prompt=prompt, params=params))
        # The job carries the same stop strings as the engine's request (the worker builds one from the other).
        job = Job(custom_id=f"s{i}", prompt=prompt, stream=True, batch_id="b", idx=i,
                  params=JobParams(max_tokens=params.max_tokens, ignore_eos=True, stop=stop))
        streams.add(f"s{i}", Delivery(job, "stream", f"{i}-0", 1))
        sent[f"s{i}"] = ""
    while reference.has_unfinished():
        for c in reference.step():
            final[c.request_id] = c.text
            streams.discard(c.request_id)
        for d, index, text in streams.step(reference):
            assert index == 0
            sent[d.job.custom_id] += text
    assert len(final) == 6
    for rid, text in final.items():
        assert text.startswith(sent[rid]), (rid, sent[rid], text)
    assert any(sent.values())
