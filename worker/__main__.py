"""``python -m sluice.worker --model M``: a worker without the CLI (the CLI's ``sluice worker`` calls ``run_worker``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import Field, asdict
from typing import Any

from sluice.engine.config import Flag, engine_flags, flag_default, flag_name, given_settings
from sluice.engine.lora.adapters import LoraError
from sluice.engine.models.base import UnsupportedModelError
from sluice.jobs.flag_values import collect, parse_value
from sluice.jobs.settings import RETRY_FLAGS, SettingsError
from sluice.worker.isolation import EngineSick
from sluice.worker.run import run_worker

EXIT_ENGINE_SICK = 3  # the engine fails even alone: a supervisor (compose, systemd) should restart us


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sluice.worker", description=__doc__)
    add_engine_flags(p)
    p.add_argument("--queue", default=None, help="queue to serve (default: the --model string)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--redis-url", default=None, help="default: SLUICE_REDIS_URL, else the embedded server")
    # Defaults: WorkerOptions'; only what is given is passed on.
    p.add_argument("--lookahead", type=int)
    for f in RETRY_FLAGS:  # spelled once in jobs/settings.py (sluice worker takes them too)
        p.add_argument(f.flag, type=_parsed(f.parse), default=None, help=f.help + f" Env: {f.envvar}.")
    p.add_argument("--grace-period", type=float)
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--exit-when-idle", type=float, help="seconds")
    return p


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """EngineConfig's flags (engine/config.py), as ``sluice worker`` has them: a flag not given reads its
    variable, else means the setting's default."""
    for f, flag in engine_flags():
        text = f"{flag.help or ''} Env: {flag.envvar}." if flag.envvar else flag.help or ""
        kw: dict[str, Any] = dict(dest=f.name, help=text.strip().replace("%", "%%"))  # argparse %-formats help
        if flag.kind == "bool":
            p.add_argument(flag_name(f, flag), action="store_true", default=_env_default(f, flag), **kw)
            continue
        kw["metavar"] = flag.metavar
        if flag.repeat:  # collected after parsing (a duplicate LoRA name is refused there)
            p.add_argument(flag_name(f, flag), action="append", type=_flag_type(flag), default=None, **kw)
        else:
            p.add_argument(flag_name(f, flag), type=_flag_type(flag), choices=flag.choices or None,
                           default=_env_default(f, flag), **kw)


def _env_default(f: Field[Any], flag: Flag) -> Any:
    """The flag's variable, parsed, where it is set; else the setting's default."""
    raw = os.environ.get(flag.envvar or "", "")
    if not raw.strip():
        return flag_default(f, flag)
    try:
        return parse_value(flag.kind, raw, flag.min, flag.choices)
    except ValueError as e:
        raise SettingsError(f"{flag.envvar}: {e}") from None


def _flag_type(flag: Flag) -> Callable[[str], Any]:
    return _parsed(lambda text: parse_value(flag.kind, str(text), flag.min, flag.choices))


def engine_settings(a: argparse.Namespace) -> tuple[str | None, dict[str, Any]]:
    """The model and the engine settings of parsed flags (as ``sluice worker`` passes them on)."""
    values = {f.name: getattr(a, f.name) for f, _ in engine_flags()}
    for f, flag in engine_flags():
        if flag.repeat:
            values[f.name] = collect(flag.kind, values[f.name] or ())
    return values.pop("model"), given_settings(values)


def main(argv: list[str] | None = None) -> None:
    try:
        p = build_parser()
    except SettingsError as e:  # a bad SLUICE_* variable of an engine flag
        sys.exit(f"python -m sluice.worker: error: {e}")
    a = p.parse_args(argv)
    try:
        for f in RETRY_FLAGS:  # the variable where the flag is not given
            if getattr(a, f.dest) is None:
                setattr(a, f.dest, f.from_env())
        model, engine = engine_settings(a)
    except (SettingsError, ValueError) as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = {f.name for f, _ in engine_flags()}
    given = {k: v for k, v in vars(a).items() if v is not None and k not in names}
    try:
        report = run_worker(model, **given, **engine)
    except UnsupportedModelError as e:  # its waiting jobs were failed with the reason
        logging.getLogger("worker").error("exiting: %s", e)
        sys.exit(1)
    except LoraError as e:  # peft missing: no adapter line could run here; other workers may serve them
        logging.getLogger("worker").error("exiting: %s", e)
        sys.exit(1)
    except EngineSick as e:
        logging.getLogger("worker").error("exiting: %s; its jobs were handed back to the queue", e)
        sys.exit(EXIT_ENGINE_SICK)
    print(json.dumps(asdict(report)))


def _parsed(parse: Callable[[object], Any]) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


if __name__ == "__main__":
    main()
