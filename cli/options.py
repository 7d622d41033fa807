"""Options shared by several commands: the engine's (``generate``, ``worker``, ``up``), the default
sampling settings (``generate``, ``submit``), and the parameter types for sizes and durations.

Options a deployment sets read an environment variable too (click's ``envvar``, shown in ``--help``),
so a container sets ``SLUICE_MODEL`` instead of building flags in a shell.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import Field
from typing import Any

import click
from pydantic import ValidationError
from sluice.engine.config import (  # a plain module (no torch)
    Flag,
    engine_flags,
    flag_default,
    flag_name,
    given_settings,
)
from sluice.jobs.flag_values import PARSERS, collect
from sluice.jobs.schemas import SamplingParams
from sluice.jobs.units import parse_duration, parse_size


class Parsed(click.ParamType):
    """A value written as text and parsed by one of ``sluice.jobs.units``' parsers (as the API and the settings
    parse it), its ValueError a usage error."""

    def __init__(self, name: str, parse: Callable[[str], Any]) -> None:
        self.name, self.parse = name, parse

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):  # a default given as a number
            return value
        try:
            return self.parse(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


SIZE = Parsed("size", parse_size)  # 2GiB, 512MB, 1000000
DURATION = Parsed("duration", parse_duration)  # 24h, 90m, 30s


def env_option(*decls: str, envvar: str, **kwargs: Any) -> Any:
    return click.option(*decls, envvar=envvar, show_envvar=True, **kwargs)


def _click_type(flag: Flag) -> Any:
    if flag.choices:
        return click.Choice(flag.choices)
    if flag.kind == "int":
        return click.IntRange(min=flag.min)
    return None if flag.kind == "text" else Parsed(flag.metavar or flag.kind, PARSERS[flag.kind])


def _collected(kind: str) -> Callable[[click.Context, click.Parameter, Any], Any]:
    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        try:
            return collect(kind, value or ())
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return callback


def engine_option(f: Field[Any], flag: Flag) -> Any:
    """The click option of one EngineConfig setting (engine/config.py holds its name, variable, help, ...)."""
    default = flag_default(f, flag)
    kw: dict[str, Any] = dict(envvar=flag.envvar, show_envvar=flag.envvar is not None, help=flag.help,
                              metavar=flag.metavar)
    if flag.kind == "bool":
        return click.option(flag_name(f, flag), f.name, is_flag=True, default=default, **kw)
    if flag.repeat:
        return click.option(flag_name(f, flag), f.name, multiple=True, default=None, type=_click_type(flag),
                            callback=_collected(flag.kind), **kw)
    return click.option(flag_name(f, flag), f.name, type=_click_type(flag), default=default,
                        show_default=default is not None, **kw)


engine_options = [engine_option(f, flag) for f, flag in engine_flags()]

sampling_options = [
    click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Default max_tokens for lines that set none."),
    click.option("--temperature", type=click.FloatRange(min=0), default=None, help="Default temperature (0 = greedy)."),
    click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None, help="Default top_p."),
    click.option("--seed", type=int, default=None, help="Default seed."),
    click.option("--chat-template-kwargs", default=None, metavar="JSON",
                 help='Chat-template options for every line, e.g. \'{"enable_thinking": false}\' (a line\'s own '
                 'chat_template_kwargs add to these, key by key).'),
]


# Planning (jobs/prefix_plan.py) is on by default; this turns it off, for a comparison or a run that must
# reach the engine in file order.
arrival_order_option = click.option(
    "--arrival-order", is_flag=True,
    help="Hand requests to the engine in input order, not grouped by shared prompt prefix.")


def _apply(options: list[Any], f: Any) -> Any:
    for option in reversed(options):
        f = option(f)
    return f


def with_engine_options(f: Any) -> Any:
    """Every engine flag on the command ``f``, which is called with ``model`` and ``engine`` (the other
    settings given, for the engine's config) in their place."""
    names = [field.name for field, _ in engine_flags()]

    @functools.wraps(f)
    def command(**kwargs: Any) -> Any:
        values = {name: kwargs.pop(name) for name in names}
        model = values.pop("model")
        return f(model=model, engine=given_settings(values), **kwargs)

    return _apply(engine_options, command)


def with_sampling_options(f: Any) -> Any:
    return _apply(sampling_options, f)


def sampling_defaults(max_tokens: int | None, temperature: float | None, top_p: float | None,
                      seed: int | None, chat_template_kwargs: str | None = None) -> SamplingParams:
    """The sampling settings lines that set none get: the flags given, else SamplingParams' own defaults.
    A bad --chat-template-kwargs is a usage error."""
    given = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
             "chat_template_kwargs": chat_template_kwargs}
    try:
        return SamplingParams(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as e:
        err = e.errors()[0]
        where = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "a sampling option"
        raise click.BadParameter(err["msg"].removeprefix("Value error, "), param_hint=where) from None
