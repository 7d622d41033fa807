"""`sluice generate`: good and bad lines, error lines with line numbers, --resume redoes nothing."""

from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import fresh_seed
from sluice.cli.main import EXIT_SOME_FAILED, cli
from sluice.engine.config import EngineConfig

LINES = [
    '{"custom_id": "a", "prompt": "Once upon a time", "max_tokens": 5}',
    '{"custom_id": "b", "messages": [{"role": "user", "content": "Hi"}]}',
    "this is not json",
    '{"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "Yo"}], "max_tokens": 4}}',
    '{"custom_id": "d", "prompt": "x", "temperature": -1}',
    "",
    '{"custom_id": "e", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}',
    '{"prompt": "no custom id here", "max_tokens": 3}',
    '{"custom_id": "f", "prompt": "x", "guided_regex": "(unclosed"}',
]


def _read(path: Path) -> dict[str, dict]:
    return {x["custom_id"]: x for x in map(json.loads, path.read_text().splitlines())}


def test_generate_writes_results_and_error_lines_then_resume_redoes_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(LINES) + "\n")
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
            "--kv-cache-memory", "16MiB", "--max-tokens", "6", "--no-progress"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    got, errors = _read(out), _read(tmp_path / "out.errors.jsonl")  # the errors file the docs promise
    assert set(got) == {"a", "b", "c", "line-8"} and set(errors) == {"line-3", "d", "e", "f"}
    got.update(errors)
    for ok in ("a", "b", "c", "line-8"):
        assert got[ok]["error"] is None and got[ok]["response"]["status_code"] == 200
    assert got["a"]["response"]["body"]["object"] == "text_completion"
    assert got["a"]["response"]["body"]["usage"]["completion_tokens"] <= 5
    assert got["b"]["response"]["body"]["object"] == "chat.completion"
    assert got["b"]["response"]["body"]["usage"]["completion_tokens"] <= 6  # the --max-tokens default
    for bad, line_no in (("line-3", 3), ("d", 5)):
        assert got[bad]["response"] is None
        assert got[bad]["error"]["message"].startswith(f"line {line_no}:"), got[bad]
    assert errors["f"]["response"]["status_code"] == 400 and "does not compile" in errors["f"]["error"]["message"]
    # An embeddings line is valid, but not for a generation model: that request fails alone.
    assert errors["e"]["response"]["status_code"] == 400 and "generates text" in errors["e"]["error"]["message"]
    assert "4 completed, 2 failed, 2 bad lines" in res.output

    before = out.read_text(), (tmp_path / "out.errors.jsonl").read_text()
    res = CliRunner().invoke(cli, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert "0 completed, 0 failed, 0 bad lines, 6 skipped" in res.output
    assert (out.read_text(), (tmp_path / "out.errors.jsonl").read_text()) == before


@pytest.mark.parametrize("order", ["planned", "arrival"])
def test_results_come_back_in_input_order(tiny_model_dir: Path, tmp_path: Path, order: str) -> None:
    """Shuffled lines of two shared prefixes and lengths that make later lines finish first: the engine
    takes them grouped (planned) or as they come, finish order differs from the input's either way, and
    the output and errors files list them in input order once the run is complete."""
    rng = random.Random(seed := fresh_seed())
    prefixes = ["You are a careful assistant. Answer in one word. " * 4, "Translate into French, please: " * 4]
    lines = [json.dumps({"custom_id": f"r{i}", "prompt": rng.choice(prefixes) + f"item {i}",
                         "max_tokens": 2 + (11 - i) % 12, "ignore_eos": True}) for i in range(12)]
    lines.insert(5, '{"custom_id": "bad1", "prompt": "x", "temperature": -1}')
    lines.insert(9, '{"custom_id": "bad2", "prompt": "x", "guided_regex": "(unclosed"}')
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    res = CliRunner().invoke(cli, ["generate", str(src), "-o", str(out), "--model", str(tiny_model_dir),
                                   "--dtype", "float32", "--kv-cache-memory", "16MiB", "--no-progress",
                                   *(["--arrival-order"] if order == "arrival" else [])])
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    ids = [json.loads(x)["custom_id"] for x in lines]
    got = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    errors = [json.loads(x)["custom_id"] for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert got == [i for i in ids if i.startswith("r")], seed
    assert errors == ["bad1", "bad2"], seed


def test_sort_by_input_keeps_unranked_lines_after_and_mends_a_cut_last_line(tmp_path: Path) -> None:
    from sluice.worker.line_order import sort_by_input

    f = tmp_path / "out.jsonl"
    f.write_text('{"custom_id": "c"}\nnot json\n{"custom_id": "a"}\n{"custom_id": "b"}')
    sort_by_input(f, {"a": 1, "b": 2, "c": 3})
    assert f.read_text() == '{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c"}\nnot json\n'


def test_resume_after_an_interrupted_run_finishes_only_the_rest(tiny_model_dir: Path, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"r{i}", "prompt": f"count {i}", "max_tokens": 3}) + "\n" for i in range(6)))
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32",
            "--kv-cache-memory", "16MiB", "--no-progress"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:2]) + "\n" + lines[2][:10])  # as if killed mid-write of the third line
    res = CliRunner().invoke(cli, args + ["--resume"])
    assert res.exit_code == 0, res.output
    assert "4 completed" in res.output and "2 skipped" in res.output
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]  # every line whole again
    assert sorted(ids) == [f"r{i}" for i in range(6)]


def test_user_errors_are_one_line_not_a_traceback(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    cases = [
        ["generate", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "o.jsonl")],
        ["generate", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "nope.gguf")],
        ["generate", str(src), "-o", str(tmp_path / "o.jsonl"), "--kv-cache-memory", "lots"],
    ]
    for args in cases:
        p = subprocess.run([sys.executable, "-m", "sluice.cli.main", *args], capture_output=True, text=True, timeout=120)
        assert p.returncode in (1, 2), p.stderr
        assert "Traceback" not in p.stderr
        assert "Error" in p.stderr


def test_a_stop_token_outside_the_vocabulary_fails_only_its_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    """It passes the line schema (the vocabulary is the model's business); the engine's front door
    refuses it, so only that request fails. It had been an IndexError in the sampler that ended the
    whole run with a traceback and no result written."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": "ok1", "prompt": "a b c", "max_tokens": 3},
             {"custom_id": "bad", "prompt": "a b c", "max_tokens": 3, "min_tokens": 2, "stop_token_ids": [10**9]},
             {"custom_id": "ok2", "prompt": "d e f", "max_tokens": 3}]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    res = CliRunner().invoke(cli, ["generate", str(src), "-o", str(out), "--model", str(tiny_model_dir),
                                   "--dtype", "float32", "--kv-cache-memory", "16MiB", "--no-progress"])
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    assert set(_read(out)) == {"ok1", "ok2"}
    errors = _read(tmp_path / "out.errors.jsonl")
    assert set(errors) == {"bad"} and "stop_token_ids must be in [0, " in errors["bad"]["error"]["message"]


def test_a_short_file_gets_a_kv_cache_for_its_own_sequences(tiny_model_dir: Path, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """The engine holds no more sequence slots than the file has sequences (n counts), so its KV cache is
    sized for those at full length, not for 256 of them: allocating the whole default cache was most of a
    one-line file's start-up."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('{"custom_id": "a", "prompt": "Hello", "max_tokens": 3}\n'
                   '{"custom_id": "b", "prompt": "Hi", "max_tokens": 3, "n": 3, "temperature": 0.5, "seed": 1}\n')
    args = ["generate", str(src), "-o", str(out), "--model", str(tiny_model_dir), "--dtype", "float32", "--no-progress"]
    with caplog.at_level(logging.INFO, logger="sluice.engine.llm"):
        res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    got = _read(out)
    assert set(got) == {"a", "b"} and len(got["b"]["response"]["body"]["choices"]) == 3
    per_seq = -(-4096 // EngineConfig().block_size)  # the tiny model's 4096 positions in the default blocks
    assert f"KV cache: {4 * per_seq} blocks" in caplog.text
    with caplog.at_level(logging.INFO, logger="sluice.engine.llm"):
        caplog.clear()
        res = CliRunner().invoke(cli, [*args, "--max-num-seqs", "2"])  # the user's cap still holds
    assert res.exit_code == 0, res.output
    assert f"KV cache: {2 * per_seq} blocks" in caplog.text
