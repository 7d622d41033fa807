"""Engine options are defined once, in EngineConfig's fields (engine/config.py): every command that builds
an engine (`sluice generate`, `sluice worker`, `sluice up`, `python -m sluice.worker`) takes each flagged
setting with the same name, default, variable and choices, reads a variable alike, and the Python API takes
every setting by name, an unknown or ill-typed one refused in one line."""

from __future__ import annotations

import argparse
from dataclasses import Field, fields
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner
from sluice.cli.main import cli
from sluice.engine.config import (
    EngineConfig,
    Flag,
    check_engine_options,
    engine_flags,
    flag_default,
    flag_name,
)
from sluice.jobs.flag_values import parse_value

COMMANDS = ("generate", "worker", "up")


def _worker_parser() -> argparse.ArgumentParser:
    from sluice.worker.__main__ import build_parser

    return build_parser()


def _action(p: argparse.ArgumentParser, dest: str) -> argparse.Action:
    (action,) = [a for a in p._actions if a.dest == dest]
    return action


def _sample(flag: Flag) -> str:
    """A value for the flag's variable other than its default."""
    if flag.choices:
        return flag.choices[1]
    return {"int": "3", "bool": "1", "size": "3MiB", "text": "none"}.get(flag.kind, "x")


def test_every_engine_command_takes_exactly_the_flagged_settings() -> None:
    """What generate, worker and up have in common is the engine's flags, no more (a flag spelled on one
    command only, outside the dataclass, shows here), and python -m sluice.worker has them all."""
    flagged = {f.name for f, _ in engine_flags()}
    shared = set.intersection(*({p.name for p in cli.commands[c].params} for c in COMMANDS)) - {"help"}
    assert shared == flagged
    dests = {a.dest for a in _worker_parser()._actions}
    assert flagged <= dests
    assert {"model", "image_url_prefixes", "lora_modules", "lora_roots"} <= flagged


@pytest.mark.parametrize("command", COMMANDS)
def test_click_options_match_the_dataclass(command: str) -> None:
    params = {p.name: p for p in cli.commands[command].params}
    for f, flag in engine_flags():
        p = params[f.name]
        assert isinstance(p, click.Option)
        assert p.opts == [flag_name(f, flag)], f.name
        assert p.default == (None if flag.repeat else flag_default(f, flag)), f.name  # repeatable: none given
        assert p.envvar == flag.envvar, f.name
        assert tuple(getattr(p.type, "choices", ())) == flag.choices, f.name
        assert p.multiple == flag.repeat and p.is_flag == (flag.kind == "bool"), f.name


def test_argparse_flags_match_the_dataclass(monkeypatch: pytest.MonkeyPatch) -> None:
    for _, flag in engine_flags():
        if flag.envvar:
            monkeypatch.delenv(flag.envvar, raising=False)
    p = _worker_parser()
    for f, flag in engine_flags():
        a = _action(p, f.name)
        assert a.option_strings == [flag_name(f, flag)], f.name
        assert a.default == (None if flag.repeat else flag_default(f, flag)), f.name
        assert tuple(a.choices or ()) == flag.choices, f.name
        assert (flag.envvar or "") in (a.help or ""), f.name


def test_variables_are_read_alike_by_click_and_argparse(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Each flag's variable, set to a value other than its default, gives every command the same value."""
    with_env = [(f, flag) for f, flag in engine_flags() if flag.envvar]
    for _, flag in with_env:
        monkeypatch.setenv(flag.envvar or "", _sample(flag))
    src = tmp_path / "in.jsonl"
    src.write_text("")
    parsed = _worker_parser().parse_args([])
    for command, args in (("generate", [str(src), "-o", str(tmp_path / "out.jsonl")]), ("worker", []), ("up", [])):
        ctx = cli.commands[command].make_context(command, list(args))
        for f, flag in with_env:
            want = parse_value(flag.kind, _sample(flag), flag.min, flag.choices)
            assert want != flag_default(f, flag), f.name  # the sample tells the variable from the default
            assert ctx.params[f.name] == want == getattr(parsed, f.name), (command, f.name)


def test_repeatable_flags_collect_alike(tmp_path: Path) -> None:
    argv = ["--lora", "a=/x", "--lora", "b=/y", "--image-url-prefix", "file:///p/", "--image-url-prefix", "s3://b/",
            "--lora-root", "/r"]
    from sluice.worker.__main__ import engine_settings

    model, from_argparse = engine_settings(_worker_parser().parse_args(["--model", "m", *argv]))
    ctx = cli.commands["worker"].make_context("worker", ["--model", "m", *argv])
    want = {"lora_modules": {"a": "/x", "b": "/y"}, "image_url_prefixes": ("file:///p/", "s3://b/"), "lora_roots": ("/r",)}
    assert model == ctx.params["model"] == "m"
    for name, value in want.items():
        assert from_argparse[name] == ctx.params[name] == value, name
    EngineConfig(**from_argparse)  # what the engine is given, it takes


def test_a_bad_flag_or_variable_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from sluice.worker.__main__ import main

    for argv, says in ((["--lora", "a=/x", "--lora", "a=/y"], "given twice"), (["--max-num-seqs", "0"], "least value"),
                       (["--kv-cache-memory", "lots"], "--kv-cache-memory"), (["--dtype", "float8"], "not one of")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv
        res = CliRunner().invoke(cli, ["worker", *argv])
        assert res.exit_code == 2, (argv, res.output)
    monkeypatch.setenv("SLUICE_MAX_NUM_SEQS", "many")
    with pytest.raises(SystemExit) as e:
        main([])
    assert "SLUICE_MAX_NUM_SEQS" in str(e.value.code) and "not an integer" in str(e.value.code)


def _names(fs: list[Field[Any]]) -> list[str]:
    return [f.name for f in fs if f.name != "model"]


def test_the_python_api_takes_every_setting_by_name() -> None:
    """sluice.generate's engine_options: every EngineConfig setting (the model is its own argument)."""
    for f in fields(EngineConfig):
        if f.name != "model":
            check_engine_options({f.name: EngineConfig().__getattribute__(f.name)})
    with pytest.raises(ValueError, match="unknown engine option 'model'"):
        check_engine_options({"model": "m"})
    listed = str(pytest.raises(ValueError, check_engine_options, {"max_num_seq": 4}).value)
    assert "'max_num_seq'" in listed and all(n in listed for n in _names(list(fields(EngineConfig))))


@pytest.mark.parametrize(("options", "says"), [
    ({"max_num_seq": 4}, "unknown engine option 'max_num_seq'"),
    ({"max_num_seqs": "4"}, "max_num_seqs must be int, not str '4'"),
    ({"enforce_eager": 1}, "enforce_eager must be bool"),
    ({"image_url_prefixes": "file:///p/"}, "image_url_prefixes must be tuple"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype must be one of"),
])
def test_the_python_api_refuses_a_bad_option_before_loading(options: dict[str, Any], says: str) -> None:
    import sluice

    rows = [{"prompt": "hi"}]
    with pytest.raises(ValueError, match=says):
        sluice.generate(rows, model="/nonexistent/model", engine_options=options, progress=False)
    assert rows == [{"prompt": "hi"}]  # the caller's rows untouched
