"""Engine settings: one plain dataclass, checked once."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("continuous", "static")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
CPU_LINEAR = ("auto", "aten", "onednn-packed", "fp32-compute")


@dataclass
class EngineConfig:
    model: str | None = None  # None = the default SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096  # token budget of one step (prefill chunks + decodes)
    block_size: int = 16
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
    # Ranks (processes, one device each on CUDA) that split every layer (engine/parallel/). The KV cache
    # budget (kv_cache_memory) is per rank: each holds its own share of the KV heads.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, not {self.attention_backend!r}")
        if self.model_impl not in ("auto", "native", "transformers"):
            raise ValueError(f"model_impl must be auto, native or transformers, not {self.model_impl!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, not {self.tensor_parallel_size}")
        if self.cpu_linear not in CPU_LINEAR:
            raise ValueError(f"cpu_linear must be one of {CPU_LINEAR}, not {self.cpu_linear!r}")
