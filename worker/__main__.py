"""``python -m sluice.worker --model M``: a worker without the CLI (the CLI's ``sluice worker`` calls ``run_worker``)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from sluice.engine.config import KV_CACHE_DTYPES
from sluice.engine.lora.adapters import LoraError
from sluice.engine.models.base import UnsupportedModelError
from sluice.jobs.keys import parse_lora_module
from sluice.jobs.settings import RETRY_FLAGS, SettingsError
from sluice.jobs.units import parse_size
from sluice.worker.isolation import EngineSick
from sluice.worker.run import run_worker

EXIT_ENGINE_SICK = 3  # the engine fails even alone: a supervisor (compose, systemd) should restart us


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sluice.worker", description=__doc__)
    p.add_argument("--model", default=None, help="model path or name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--queue", default=None, help="queue to serve (default: the --model string)")
    p.add_argument("--worker-id", default=None)
    p.add_argument("--redis-url", default=None, help="default: SLUICE_REDIS_URL, else the embedded server")
    p.add_argument("--dtype")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=parse_size, default=None, help="a size: 2GiB, 512MB or bytes")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None, help="auto (the model's dtype) or int8")
    p.add_argument("--lora", action="append", type=_lora, default=None, metavar="NAME=PATH",
                   help="a LoRA adapter lines may ask for as model BASE:NAME or NAME (repeatable)")
    p.add_argument("--max-loras", type=int)
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-root", dest="lora_roots", action="append", default=None, metavar="DIR_OR_URL",
                   help="where adapters lines name as BASE:NAME are loaded from when not loaded (repeatable)")
    p.add_argument("--max-cpu-loras", type=int, help="loaded adapters kept in CPU memory (default: 4 x max-loras)")
    p.add_argument("--image-url-prefix", action="append", default=None, metavar="PREFIX",
                   help="image URLs lines may name besides data: URLs, e.g. file:///data/photos/ or s3://bucket/ "
                        "(repeatable; default: none, so a line cannot make the worker read a file)")
    # Defaults: WorkerOptions' and EngineConfig's; only what is given is passed on.
    p.add_argument("--lookahead", type=int)
    for f in RETRY_FLAGS:  # spelled once in jobs/settings.py (sluice worker takes them too)
        p.add_argument(f.flag, type=_parsed(f.parse), default=None, help=f.help + f" Env: {f.envvar}.")
    p.add_argument("--grace-period", type=float)
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--exit-when-idle", type=float, help="seconds")
    a = p.parse_args(argv)
    try:
        for f in RETRY_FLAGS:  # the variable where the flag is not given
            if getattr(a, f.dest) is None:
                setattr(a, f.dest, f.from_env())
    except SettingsError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    given = {k: v for k, v in vars(a).items() if v is not None and k not in ("model", "lora", "image_url_prefix")}
    if a.image_url_prefix:
        given["image_url_prefixes"] = tuple(a.image_url_prefix)
    if a.lora:
        given["lora_modules"] = dict(a.lora)
    try:
        report = run_worker(a.model, **given)
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


def _lora(spec: str) -> tuple[str, str]:
    try:
        return parse_lora_module(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


if __name__ == "__main__":
    main()
