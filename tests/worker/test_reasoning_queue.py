"""Reasoning models through the queue (issue 23): `sluice submit --wait` with a batch-wide --chat-template-kwargs, a worker on
the tiny reasoning model, and the results in OpenAI's shapes (reasoning_content, reasoning_tokens, a
scoring line's echoed prompt logprobs with max_tokens 0)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_api_helpers import sluice_home, tiny_worker
from click.testing import CliRunner
from openai.types.chat import ChatCompletion
from reasoning_model import make_reasoning_model
from sluice.cli.main import cli

ASK = [{"role": "user", "content": "Is the sky blue?"}]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    model = make_reasoning_model(tmp_path_factory.mktemp("think") / "m", seed=5)
    with sluice_home(tmp_path_factory.mktemp("think") / "home") as h, tiny_worker(model, queue="think"):
        yield h


def test_submit_reasoning_and_scoring_lines(home: Path, tmp_path: Path) -> None:
    lines = [{"custom_id": "off", "messages": ASK, "max_tokens": 4},
             {"custom_id": "on", "messages": ASK, "max_tokens": 6, "max_reasoning_tokens": 2,
              "chat_template_kwargs": {"enable_thinking": True}},
             {"custom_id": "score", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "The sky is blue.", "echo": True, "logprobs": 1, "max_tokens": 0}}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(cli, ["submit", str(src), "--model", "think", "--wait", "-o", str(out),
                                   "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert res.exit_code == 0, res.output
    got = {x["custom_id"]: x["response"]["body"] for x in map(json.loads, out.read_text().splitlines())}
    ChatCompletion.model_validate(got["on"])
    assert "reasoning_content" not in got["off"]["choices"][0]["message"]
    on = got["on"]
    assert on["choices"][0]["message"]["reasoning_content"] is not None
    assert on["usage"]["completion_tokens_details"]["reasoning_tokens"] == 3
    score = got["score"]
    lp = score["choices"][0]["logprobs"]
    assert score["choices"][0]["text"] == "The sky is blue." and score["usage"]["completion_tokens"] == 0
    assert lp["token_logprobs"][0] is None and all(x <= 0 for x in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == "The sky is blue."
