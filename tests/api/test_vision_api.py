"""Image lines through the API: online ``/v1/chat/completions`` and a Batch, with the unmodified openai SDK
against a live ``sluice serve`` and a worker on a tiny LLaVA; answers are the in-process engine's, usage
counts the image's tokens, a corrupt image fails its own request (400 online, an error line in a batch)."""

from __future__ import annotations

import io
import json
import os
import random
import time
from pathlib import Path

import openai
import pytest
from cli_api_helpers import sluice_home, start_sluice, stop, wait_for_url
from helpers import fresh_seed
from jobs_helpers import ThreadWorker
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.jobs.lines import normalize_messages
from vision_helpers import data_url, make_tiny_llava, random_image

KEY = "sk-sluice-test"


def test_online_and_batch_image_requests(tmp_path: Path) -> None:
    model = make_tiny_llava(tmp_path / "llava" / "m", seed=4)
    rng = random.Random(fresh_seed())
    content = [{"type": "text", "text": "what is this?"},
               {"type": "image_url", "image_url": {"url": data_url(random_image(rng, 50, 40))}}]
    messages = [{"role": "user", "content": content}]
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}]}]
    ref = LLM(str(model), dtype="float32", kv_cache_memory=8 << 20)
    (want,) = ref.generate([Request("x", messages=normalize_messages(messages), params=SamplingParams(max_tokens=6))])
    with sluice_home(tmp_path / "home") as home:
        llm = LLM(str(model), dtype="float32", kv_cache_memory=8 << 20)
        worker = ThreadWorker(llm, queue="llava")
        log = home.parent / "serve.log"
        proc = start_sluice("serve", "--port", "0", "--log-level", "warning", log=log,
                            env={**os.environ, "SLUICE_API_KEY": KEY})
        try:
            url = wait_for_url(proc, log, timeout=60)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
            got = client.chat.completions.create(model="llava", messages=messages, max_tokens=6, temperature=0)
            assert got.choices[0].message.content == want.text
            assert got.usage is not None and got.usage.prompt_tokens == len(want.prompt_token_ids) > 36
            with pytest.raises(openai.BadRequestError, match="cannot be decoded"):
                client.chat.completions.create(model="llava", messages=bad, max_tokens=6)

            lines = [{"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": "llava", "messages": m, "max_tokens": 6, "temperature": 0}}
                     for cid, m in (("good", messages), ("bad", bad))]
            f = client.files.create(file=("in.jsonl", io.BytesIO("".join(json.dumps(x) + "\n" for x in lines).encode())),
                                    purpose="batch")
            batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            deadline = time.monotonic() + 300
            while batch.status not in ("completed", "failed", "expired", "cancelled") and time.monotonic() < deadline:
                time.sleep(0.5)
                batch = client.batches.retrieve(batch.id)
            assert batch.status == "completed" and batch.output_file_id and batch.error_file_id, batch
            out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
            errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
            assert [x["custom_id"] for x in out] == ["good"] and [x["custom_id"] for x in errors] == ["bad"]
            assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == want.text
            assert "cannot be decoded" in json.dumps(errors[0])
        finally:
            assert stop(proc) == 0
            worker.join()
