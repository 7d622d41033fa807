"""`sluice generate` and the Python API on image lines: the same text as the engine on the same line, a bad
image failing only its line."""

from __future__ import annotations

import json
import random
from pathlib import Path

from click.testing import CliRunner
from helpers import fresh_seed
from sluice.cli.main import EXIT_SOME_FAILED, cli
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from sluice.jobs.lines import normalize_messages
from vision_helpers import data_url, image_bytes, make_tiny_llava, random_image


def test_generate_takes_image_lines(tmp_path: Path) -> None:
    model = make_tiny_llava(tmp_path / "llava" / "m", seed=3)
    img = random_image(random.Random(fresh_seed()), 45, 60)
    content = [{"type": "image_url", "image_url": {"url": data_url(img)}}, {"type": "text", "text": "caption it"}]
    lines = [{"custom_id": "img", "messages": [{"role": "user", "content": content}], "max_tokens": 6},
             {"custom_id": "bad", "messages": [{"role": "user", "content": [
                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}], "max_tokens": 6}]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(cli, ["generate", str(src), "-o", str(out), "--model", str(model), "--dtype", "float32",
                                   "--kv-cache-memory", "16MiB", "--no-progress"])
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    got = {x["custom_id"]: x for x in map(json.loads, out.read_text().splitlines())}
    errors = {x["custom_id"]: x for x in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert set(got) == {"img"} and set(errors) == {"bad"}
    assert "cannot be decoded" in errors["bad"]["error"]["message"]
    llm = LLM(str(model), dtype="float32", kv_cache_memory=16 << 20)
    (c,) = llm.generate([Request("x", messages=normalize_messages(lines[0]["messages"]),
                                 params=SamplingParams(max_tokens=6, temperature=0))])
    body = got["img"]["response"]["body"]
    assert body["choices"][0]["message"]["content"] == c.text
    assert body["usage"]["prompt_tokens"] == len(c.prompt_token_ids) > 36  # the image's 36 tokens counted


def test_python_api_takes_image_messages(tmp_path: Path) -> None:
    """sluice.generate over rows whose messages hold image parts: the engine's text per row."""
    import sluice

    model = make_tiny_llava(tmp_path / "llava" / "m", seed=3)
    rng = random.Random(fresh_seed())
    rows = [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(random_image(rng, 40 + i, 50))}},
        {"type": "text", "text": f"caption {i}"}]}]} for i in range(3)]
    llm = LLM(str(model), dtype="float32", kv_cache_memory=16 << 20)
    out = sluice.generate(rows, llm=llm, max_tokens=5, temperature=0, progress=False)
    want = llm.generate([Request(f"x{i}", messages=normalize_messages(r["messages"]),
                                 params=SamplingParams(max_tokens=5, temperature=0)) for i, r in enumerate(rows)])
    assert [r["completion"] for r in out] == [c.text for c in want]
    assert llm.stats["images_encoded"] == 3  # the second run: from the prefix and encoder caches


def test_generate_reads_image_files_only_under_image_url_prefix(tmp_path: Path) -> None:
    """`sluice generate --image-url-prefix` (an engine flag like the others): a file under the prefix is read,
    one outside it fails only its own line, with the reason; without the flag, both fail."""
    model = make_tiny_llava(tmp_path / "llava" / "m", seed=3)
    rng = random.Random(fresh_seed())
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    for d in (allowed, outside):
        d.mkdir()
        (d / "a.png").write_bytes(image_bytes(random_image(rng, 45, 60)))
    lines = [{"custom_id": cid, "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"file://{d}/a.png"}}, {"type": "text", "text": "caption it"}]}]}
        for cid, d in (("in", allowed), ("out", outside))]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for prefixes, completed in (([f"file://{allowed}/"], {"in"}), ([], set())):
        out = tmp_path / f"out{len(prefixes)}.jsonl"
        flags = [a for p in prefixes for a in ("--image-url-prefix", p)]
        res = CliRunner().invoke(cli, ["generate", str(src), "-o", str(out), "--model", str(model), "--dtype",
                                       "float32", "--kv-cache-memory", "16MiB", "--no-progress", *flags])
        assert res.exit_code == EXIT_SOME_FAILED, res.output
        got = {x["custom_id"] for x in map(json.loads, out.read_text().splitlines())}
        errors = {x["custom_id"]: x["error"]["message"]
                  for x in map(json.loads, out.with_suffix(".errors.jsonl").read_text().splitlines())}
        assert got == completed and set(errors) == {"in", "out"} - completed
        assert all("not under an allowed image URL prefix" in m for m in errors.values()), errors
