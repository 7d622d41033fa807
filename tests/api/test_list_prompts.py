"""OpenAI's list prompt on ``/v1/completions`` (issue 42, item 1), driven by the unmodified ``openai`` SDK
against a live ``sluice serve`` and a worker on the tiny model: several prompts (strings or token-id lists)
in one request give n x prompts choices in OpenAI's order (index = prompt index x n + sample), each the
answer the prompt gets alone, usage summed; lm-eval's loglikelihood request (token ids, echo, logprobs,
max_tokens 1) scores each prompt as alone; streamed, each choice's pieces add up to its text; in a batch
file, one result per custom_id holding every choice; a bad prompt fails its request (or line) alone."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from cli_api_helpers import WORDS, serving, sluice_home, tiny_worker, wait_final
from helpers import fresh_seed
from jobs_helpers import wait_for
from openai.types import Completion
from sluice.jobs import keys
from sluice.jobs.connection import connect

KEY = "sk-sluice-test"


@dataclass
class Live:
    url: str
    tokenizer: Any

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    from transformers import AutoTokenizer

    home = tmp_path_factory.mktemp("lists") / "home"
    with sluice_home(home), tiny_worker(tiny_model_dir, queue="tiny"):
        with serving(home.parent / "serve.log", KEY) as url:
            yield Live(url, AutoTokenizer.from_pretrained(str(tiny_model_dir)))


def _prompts(rng: random.Random, k: int) -> list[str]:
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8))) for _ in range(k)]


def _left_behind() -> list[str]:
    """Keys of online requests still in the job server, once a stream's end (which the server handles
    just after its last event reaches the client) has had time to clean up."""
    def keys_left() -> list[str]:
        r = connect()
        return [k for k in r.scan_iter(match=f"{keys.PREFIX}:*{{req_*")] + list(r.zrange(keys.interactive("tiny"), 0, -1))

    try:
        return wait_for(lambda: not keys_left(), 30, "the requests' keys to go") and []
    except AssertionError:
        return keys_left()


def _alone(client: openai.OpenAI, prompt: Any, **kw: Any) -> Completion:
    return client.completions.create(model="tiny", prompt=prompt, temperature=0, **kw)


def test_string_and_token_id_lists_give_each_prompts_choices_in_order(live: Live) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    client = live.client()
    prompts = _prompts(rng, rng.randint(2, 5))
    max_tokens = rng.randint(2, 6)
    alone = [_alone(client, p, max_tokens=max_tokens) for p in prompts]
    ids = [live.tokenizer(p)["input_ids"] for p in prompts]
    for prompt in (prompts, ids):
        got = _alone(client, prompt, max_tokens=max_tokens, n=2)
        assert got.object == "text_completion" and len(got.choices) == 2 * len(prompts), f"seed={seed}"
        assert [c.index for c in got.choices] == list(range(2 * len(prompts)))
        for k, one in enumerate(alone):  # greedy: both samples are the prompt's own answer
            for c in got.choices[2 * k:2 * k + 2]:
                assert (c.text, c.finish_reason) == (one.choices[0].text, one.choices[0].finish_reason), f"seed={seed}"
        assert got.usage is not None
        assert got.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
        assert got.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone if a.usage)
    assert _left_behind() == []


def test_lm_eval_loglikelihood_request_scores_each_prompt_as_alone(live: Live) -> None:
    """lm-eval's local-completions sends token ids, echo, logprobs 1 and max_tokens 1, several prompts at once."""
    seed = fresh_seed()
    rng = random.Random(seed)
    client = live.client()
    ids = [live.tokenizer(p)["input_ids"] for p in _prompts(rng, 8)]
    got = _alone(client, ids, max_tokens=1, echo=True, logprobs=1, seed=1234)
    assert len(got.choices) == len(ids)
    for k, p in enumerate(ids):
        one = _alone(client, p, max_tokens=1, echo=True, logprobs=1, seed=1234).choices[0]
        c = got.choices[k]
        assert c.index == k and c.logprobs is not None and one.logprobs is not None
        assert c.logprobs.tokens == one.logprobs.tokens and len(c.logprobs.tokens or []) == len(p) + 1, f"seed={seed}"
        assert c.logprobs.token_logprobs == pytest.approx(one.logprobs.token_logprobs, abs=1e-5), f"seed={seed}"
        assert c.logprobs.token_logprobs[0] is None and c.text == one.text


def test_streamed_list_prompt_pieces_add_up_per_choice(live: Live) -> None:
    rng = random.Random(fresh_seed())
    client = live.client()
    prompts = _prompts(rng, 3)
    whole = _alone(client, prompts, max_tokens=5, n=2)
    texts: dict[int, str] = {}
    finished: dict[int, str | None] = {}
    for chunk in _alone(client, prompts, max_tokens=5, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}
    assert _left_behind() == []


def test_bad_prompts_are_a_400_and_a_bad_token_id_fails_its_request(live: Live) -> None:
    client = live.client()
    for prompt, fragment in [(["a", []], "prompt[1] must be a string or a list of token ids"),
                             ([[1, 2], ["x"]], "prompt[1] must be"), ([], "prompt must be")]:
        with pytest.raises(openai.BadRequestError) as e:
            _alone(client, prompt, max_tokens=2)
        assert fragment in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:  # the engine refuses the second prompt's token: all fail
        _alone(client, [[1, 2], [10**6]], max_tokens=2)
    assert "prompt[1]:" in str(e.value)
    assert _alone(client, [[1, 2], [3, 4]], max_tokens=2).choices[1].index == 1  # the worker goes on
    assert _left_behind() == []


def test_batch_file_line_with_a_list_prompt_is_one_result_with_every_choice(live: Live) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    client = live.client()
    prompts = _prompts(rng, 3)
    alone = [_alone(client, p, max_tokens=4).choices[0].text for p in prompts]
    lines = [{"custom_id": "many", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 4, "temperature": 0}},
             {"custom_id": "one", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": prompts[:1], "max_tokens": 4, "temperature": 0}},
             {"custom_id": "bad", "method": "POST", "url": "/v1/completions",
              "body": {"model": "tiny", "prompt": ["a", 7], "max_tokens": 4}}]
    f = client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    batch = wait_final(lambda: client.batches.retrieve(batch.id))
    assert batch.status == "completed" and batch.output_file_id and batch.error_file_id, batch
    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == ["many", "one"]
    bodies = {x["custom_id"]: Completion.model_validate(x["response"]["body"]) for x in out}
    assert [(c.index, c.text) for c in bodies["many"].choices] == [
        (i, alone[i // 2]) for i in range(6)], f"seed={seed}"
    assert [c.text for c in bodies["one"].choices] == alone[:1]
    errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
    assert len(errors) == 1 and "line 3" in errors[0]["error"]["message"] and "prompt" in errors[0]["error"]["message"]


def test_sluice_generate_runs_a_list_prompt_line_as_one_result(tiny_model_dir: Path, tmp_path: Path) -> None:
    """In-process (no queue): a list prompt's line is one output line with every prompt's choices, each
    the answer its prompt gets on a line of its own; a refused prompt fails only its line."""
    from click.testing import CliRunner
    from sluice.cli.main import EXIT_SOME_FAILED, cli

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": "many", "prompt": ["a b c", "d e f"], "n": 2, "max_tokens": 3},
             {"custom_id": "a", "prompt": "a b c", "max_tokens": 3}, {"custom_id": "d", "prompt": "d e f", "max_tokens": 3},
             {"custom_id": "bad", "prompt": [[1, 2], [10**6]], "max_tokens": 3}]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(cli, ["generate", str(src), "-o", str(out), "--model", str(tiny_model_dir),
                                   "--dtype", "float32", "--kv-cache-memory", "16MiB", "--no-progress"])
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    got = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, out.read_text().splitlines())}
    assert sorted(got) == ["a", "d", "many"]
    texts = [c["text"] for c in got["many"]["choices"]]
    assert texts == [got["a"]["choices"][0]["text"]] * 2 + [got["d"]["choices"][0]["text"]] * 2
    assert got["many"]["usage"]["prompt_tokens"] == got["a"]["usage"]["prompt_tokens"] + got["d"]["usage"]["prompt_tokens"]
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["bad"] and "prompt[1]:" in errors[0]["error"]["message"]
