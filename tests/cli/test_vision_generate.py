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


def _image_rows(tmp_path: Path, rng: random.Random) -> list[dict[str, object]]:
    from vision_helpers import image_bytes

    imgs = [random_image(rng, 40 + 3 * i, 50) for i in range(3)]
    paths = []
    for i, img in enumerate(imgs):
        paths.append(tmp_path / "imgs" / f"{i}.png")
        paths[-1].parent.mkdir(exist_ok=True)
        paths[-1].write_bytes(image_bytes(img))
    rows: list[dict[str, object]] = [{"text": f"caption {i}", "image": image_bytes(img), "path": str(p)}
                                     for i, (img, p) in enumerate(zip(imgs, paths, strict=True))]
    rows.append({"text": "caption bad", "image": b"\x89PNG not really", "path": str(tmp_path / "imgs" / "bad.png")})
    (tmp_path / "imgs" / "bad.png").write_bytes(b"\x89PNG not really")
    return rows


def test_image_column_in_a_dataset_equals_the_chat_line(tmp_path: Path) -> None:
    """--image-column (issue 45): a Parquet column of image bytes, and one of paths (read only under the
    engine's image_url_prefixes), each row an image part with its prompt: the same greedy tokens as the
    chat line; a corrupt image fails its row only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = make_tiny_llava(tmp_path / "llava" / "m", seed=3)
    seed = fresh_seed()
    rows = _image_rows(tmp_path, random.Random(seed))
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    llm = LLM(str(model), dtype="float32", kv_cache_memory=16 << 20, image_url_prefixes=(f"file://{(tmp_path / 'imgs').resolve()}/",))
    want = llm.generate([Request(f"x{i}", messages=normalize_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url_of(r["image"])}}, {"type": "text", "text": r["text"]}]}]),
        params=SamplingParams(max_tokens=6, temperature=0)) for i, r in enumerate(rows[:3])])
    import sluice

    for column in ("image", "path"):  # bytes as a data: URL; a path as the engine reads a chat line's
        out = sluice.generate(str(src), prompt_column="text", image_column=column, llm=llm, max_tokens=6,
                              temperature=0, progress=False).to_pylist()
        assert [r["completion"] for r in out[:3]] == [c.text for c in want], (column, seed)
        assert [r["usage"]["completion_tokens"] for r in out[:3]] == [len(c.outputs[0].token_ids) for c in want]
        assert all(r["error"] is None for r in out[:3]) and out[3]["completion"] is None, column
        assert "cannot be decoded" in out[3]["error"]["message"], out[3]["error"]


def test_image_column_on_the_command_line(tmp_path: Path) -> None:
    """``sluice generate DATASET --image-column``: the bytes column's rows as the Python API's, the bad one failed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = make_tiny_llava(tmp_path / "llava" / "m", seed=3)
    rows = _image_rows(tmp_path, random.Random(fresh_seed()))
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    res = CliRunner().invoke(cli, ["generate", str(src), "-o", str(out), "--model", str(model), "--dtype", "float32",
                                   "--kv-cache-memory", "16MiB", "--no-progress", "--prompt-column", "text",
                                   "--image-column", "image", "--max-tokens", "6"])
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    got = pq.read_table(out).to_pylist()
    llm = LLM(str(model), dtype="float32", kv_cache_memory=16 << 20)
    want = [c.text for c in llm.generate([Request(f"x{i}", messages=normalize_messages([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url_of(r["image"])}}, {"type": "text", "text": r["text"]}]}]),
        params=SamplingParams(max_tokens=6, temperature=0)) for i, r in enumerate(rows[:3])])]
    assert [r["completion"] for r in got] == [*want, None]
    assert "cannot be decoded" in got[3]["error"]["message"]


def data_url_of(data: object) -> str:
    import base64

    assert isinstance(data, bytes)
    return "data:image/png;base64," + base64.b64encode(data).decode()
