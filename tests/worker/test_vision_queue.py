"""Image lines through the queue: a real ``python -m sluice.worker`` on a tiny LLaVA and the embedded Valkey.
Good lines (data: URLs, a file under the worker's --image-url-prefix, text only) complete with the in-process
engine's text, image tokens counted in usage; a corrupt image, a 50-megapixel image, a path outside the
allowed prefix, a missing file and an unreachable URL each fail their own line with a clear error."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import redis
from helpers import fresh_seed
from jobs_helpers import assert_exactly_once, finish_with, worker_process
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.jobs.store import get_batch
from sluice.jobs.submit import submit
from vision_helpers import data_url, image_bytes, make_tiny_llava, random_image

pytest_plugins = ["jobs_fixtures"]
MAX_NEW = 8


def _line(cid: str, content: Any) -> str:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW, "temperature": 0}
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body})


def _image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def test_image_lines_on_the_queue_bad_ones_fail_alone(r: redis.Redis, tmp_path: Path) -> None:
    from PIL import Image

    rng = random.Random(fresh_seed())
    model = make_tiny_llava(tmp_path / "llava" / "m", seed=2)
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir()
    outside.mkdir()
    a, b = random_image(rng, 60, 40), random_image(rng, 33, 80)
    (allowed / "b.png").write_bytes(image_bytes(b))
    (outside / "b.png").write_bytes(image_bytes(b))
    huge = data_url(Image.new("L", (10_000, 5_000)))  # 50 megapixels of zeros: a small PNG
    good = {
        "data": [_image_part(data_url(a)), {"type": "text", "text": "what is in the picture?"}],
        "file": [{"type": "text", "text": "and here?"}, _image_part(str(allowed / "b.png"))],
        "text": "just words",
    }
    bad = {
        "corrupt": ([_image_part("data:image/png;base64," + "QUJD" * 50)], "cannot be decoded"),
        "huge": ([_image_part(huge)], "50000000 pixels, over max_image_pixels"),
        "outside": ([_image_part(str(outside / "b.png"))], "not under an allowed image URL prefix"),
        "dotdot": ([_image_part(str(allowed / ".." / "outside" / "b.png"))], "not under an allowed image URL prefix"),
        "missing": ([_image_part(f"file://{allowed}/nope.png")], "could not be read"),
        "unreachable": ([_image_part("http://127.0.0.1:9/x.png")], "could not be read"),
    }
    lines = [_line(k, v) for k, v in good.items()] + [_line(k, v) for k, (v, _) in bad.items()]
    batch = submit(lines, r=r, model="tiny")
    log = tmp_path / "worker.log"
    p = worker_process(model, "w1", "--exit-when-idle", "2", "--image-url-prefix", f"file://{allowed}/",
                       "--image-url-prefix", "http://127.0.0.1:9/", log=log)
    finish_with(r, batch.id, p, log, 600)
    entries = {e["custom_id"]: e for e in assert_exactly_once(r, batch.id, len(lines))}
    assert get_batch(r, batch.id).status == "completed"

    llm = LLM(str(model), dtype="float32", kv_cache_memory=8 << 20, image_url_prefixes=(f"file://{allowed}/",))
    from sluice.jobs.lines import normalize_messages

    reqs = [Request(k, messages=normalize_messages([{"role": "user", "content": v}]),
                    params=SamplingParams(max_tokens=MAX_NEW)) for k, v in good.items()]
    for c in llm.generate(reqs):
        e = entries[c.request_id]
        assert e["status"] == "completed", e
        assert e["text"] == c.text and e["usage"]["prompt_tokens"] == len(c.prompt_token_ids)
    image_id = llm.vision.image_token_id if llm.vision is not None else -1
    with_image = llm.generate([Request("x", messages=normalize_messages([{"role": "user", "content": good["data"]}]),
                                        params=SamplingParams(max_tokens=1))])
    assert with_image[0].prompt_token_ids.count(image_id) == 36  # usage counts the image's tokens
    for k, (_, fragment) in bad.items():
        e = entries[k]
        assert e["status"] == "failed" and fragment in e["error"]["message"], (k, e)
