"""Engine settings: one plain dataclass, checked once."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("continuous", "static")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
CPU_LINEAR = ("auto", "aten", "onednn-packed", "fp32-compute")
QUANTIZATIONS = ("auto", "int8", "w8a8", "int4")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # fp8 is named so that asking for it gets a reason, not a usage error


@dataclass
class EngineConfig:
    model: str | None = None  # None = the default SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096  # token budget of one step (prefill chunks + decodes)
    # Tokens per KV block. 32: the CPU GEMM attention multiplies a query tile by one block of keys at a time,
    # and 32-key blocks ran its prompt chunks 1.6x faster than 16 (bench/attention_micro.py, AVX512-BF16);
    # the Triton kernels tile keys independently of it.
    block_size: int = 32
    kv_cache_memory: int | None = None  # bytes for the KV cache; None = a default for the device
    gpu_memory_utilization: float = 0.9  # CUDA: share of total memory the engine may hold
    max_model_len: int | None = None  # None = the model's own limit
    policy: str = "continuous"  # "static" exists only as the benchmark baseline
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | cpu (C++ op) | torch (PyTorch fallback) | triton
    enforce_eager: bool = False  # CUDA: no graph capture of decode steps
    # Pad decode-only steps to a few batch sizes (engine/graph_runner.py). None = where graphs are
    # captured (CUDA, Triton, not enforce_eager); True elsewhere runs them padded but eager (tests).
    pad_decode: bool | None = None
    model_impl: str = "auto"  # auto (native where it exists, else transformers) | native | transformers
    # CPU GEMMs (engine/linear.py): auto = the fastest measured at load | aten | onednn-packed | fp32-compute.
    # Off the CPU, always aten.
    cpu_linear: str = "auto"
    # Think delimiters (engine/reasoning.py): auto = found in the tokenizer's vocabulary | a parser's name | none.
    reasoning_parser: str = "auto"
    # Weights (engine/quant/methods.py): auto = the checkpoint's own (dense if none) | int8 (weight-only,
    # quantized at load) | w8a8 | int4 (transformers path, torchao).
    quantization: str = "auto"
    # Bytes for the weights and the KV cache together: the KV cache gets what the loaded weights leave
    # (their real bytes, so quantized weights leave more). None = kv_cache_memory or the device's default.
    memory_budget: int | None = None
    # KV cache (engine/kv_quant.py): auto = the model's dtype | int8 (a scale per token and KV head; about twice
    # the blocks for the same kv_cache_memory).
    kv_cache_dtype: str = "auto"
    # LoRA adapters (engine/lora/): name -> peft folder; requests name one in Request.lora. At most
    # max_loras of them in memory and in one step's batch; ranks up to max_lora_rank.
    lora_modules: dict[str, str] | None = None
    max_loras: int = 4
    max_lora_rank: int = 64
    # Where adapters no one registered are loaded from when a request names them (engine/lora/sources.py):
    # local folders or fsspec prefixes; and how many loaded adapters CPU memory keeps (None: 4 x max_loras).
    lora_roots: tuple[str, ...] | list[str] | None = None
    max_cpu_loras: int | None = None
    # Ranks (processes, one device each on CUDA) that split every layer (engine/parallel/). The KV cache
    # budget (kv_cache_memory) is per rank: each holds its own share of the KV heads.
    tensor_parallel_size: int = 1
    # Images in chat requests to vision-language models (engine/vision.py, engine/image_source.py): data: URLs
    # always; other URLs (paths, file://, s3://, https://) only under these prefixes (none by default).
    image_url_prefixes: tuple[str, ...] = ()
    max_image_bytes: int = 20 << 20  # one image's encoded bytes
    max_image_pixels: int = 25_000_000  # width x height, read from the header before decoding
    max_images_per_request: int = 16
    image_cache_size: int = 256  # images whose encoder rows a worker keeps, by content hash

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, not {self.attention_backend!r}")
        if self.model_impl not in ("auto", "native", "transformers"):
            raise ValueError(f"model_impl must be auto, native or transformers, not {self.model_impl!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, not {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, not {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8":
            raise ValueError("--kv-cache-dtype fp8 is not implemented: use int8 (8 bits a value too, with a scale "
                             "per token and KV head)")
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
