"""Text -> value for each kind of engine flag (``sluice.engine.config.Flag.kind``): the click options
(cli/options.py) and ``python -m sluice.worker``'s argparse flags read a flag, or its variable, alike."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from sluice.jobs.keys import parse_lora_module
from sluice.jobs.units import parse_size

TRUE, FALSE = ("1", "true", "t", "yes", "y", "on"), ("0", "false", "f", "no", "n", "off", "")  # click's words


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE or word in FALSE:
        return word in TRUE
    raise ValueError(f"{text!r} is not a boolean (1/0, true/false, yes/no, on/off)")


def parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


PARSERS: dict[str, Callable[[str], Any]] = {"text": str, "int": parse_int, "bool": parse_bool, "size": parse_size,
                                            "lora": parse_lora_module}


def parse_value(kind: str, text: str, minimum: int | None = None, choices: tuple[str, ...] = ()) -> Any:
    """One flag's text as its kind's value; a ValueError says what is wrong."""
    value = PARSERS[kind](text)
    if minimum is not None and value < minimum:
        raise ValueError(f"{value} is below the least value, {minimum}")
    if choices and value not in choices:
        raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
    return value


def collect(kind: str, values: Iterable[Any]) -> tuple[Any, ...] | dict[str, str]:
    """A repeatable flag's values: a tuple; LoRA adapters' (name, path) pairs a dict, a name given twice refused."""
    if kind != "lora":
        return tuple(values)
    out: dict[str, str] = {}
    for name, path in values:
        if name in out:
            raise ValueError(f"LoRA adapter {name!r} given twice")
        out[name] = path
    return out
