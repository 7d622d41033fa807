"""The plans (full on a GPU, dry on CPU), the row reporter and the timer every section shares."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

# Llama-3.2-1B: 16 layers, 32 query heads over 8 KV heads of 64, tied embeddings, llama3 RoPE.
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    max_position_embeddings=131072,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    bos_token_id=1,
    eos_token_id=2,
)
TINY = dict(LLAMA_1B, vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rope_parameters=dict(LLAMA_1B["rope_parameters"], original_max_position_embeddings=256))  # fmt: skip
H200_TBS = 4.3  # HBM3e, the H200's datasheet bandwidth (and what a device copy measured here)
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}  # bf16 keeps 8 mantissa bits: 2**-8 rounding


@dataclass
class Plan:
    """Every size the check uses; --dry-run swaps in tiny ones."""

    device: str
    dtypes: list[str]  # correctness
    check_max_len: int
    check_batch: int
    decode_dtype: str
    decode_batches: list[int]
    decode_contexts: list[int]
    split_sweep: list[int]
    copy_mib: int
    prefill_batch: int
    prefill_len: int
    fused_tokens: list[int]
    model: dict[str, Any]
    model_dtype: str
    requests: int
    len_range: tuple[int, int]
    budget_s: float  # wall clock for the whole run
    graph_batches: list[int]  # decode batch sizes timed with graphs on and off
    graph_context: int  # prompt tokens of each sequence in those steps
    graph_steps: int  # timed decode steps per batch size
    graph_budget_s: float  # time limit of the graphs child
    engine_budget_s: float  # time limit of the engine child
    logit_len: int  # prompt tokens of each logits comparison
    small_new_tokens: int  # tokens generated per request by the small float32 model's checks
    small_max_prompt: int
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    engine_check_kwargs: dict[str, Any] = field(default_factory=dict)  # the engine child's bf16 engine
    graph_kwargs: dict[str, Any] = field(default_factory=dict)  # engine settings of the graphs child
    hf_batching: dict[str, Any] | None = None  # ContinuousBatchingConfig; None = sized from free memory


FULL = Plan(
    device="cuda",
    dtypes=["bfloat16", "float16"],
    check_max_len=2000,
    check_batch=16,
    decode_dtype="bfloat16",
    decode_batches=[64, 256],
    decode_contexts=[512, 2048, 8192],
    split_sweep=[1, 2, 4, 8, 16, 32],
    copy_mib=2048,
    prefill_batch=4,
    prefill_len=2048,
    fused_tokens=[256, 4096],
    model=LLAMA_1B,
    model_dtype="bfloat16",
    requests=256,
    len_range=(100, 1024),
    budget_s=420.0,  # from after the imports, inside gpu_check.sh's 500 s timeout
    graph_batches=[1, 8, 32, 64, 128, 256],
    graph_context=512,
    graph_steps=30,
    graph_budget_s=100.0,
    engine_budget_s=100.0,
    logit_len=700,
    small_new_tokens=24,
    small_max_prompt=60,
    engine_kwargs=dict(max_num_seqs=256, max_model_len=2048),
    # A share of the memory (the real sizing path: warm-up, graph reserve); 64 sequences: 9 buckets to capture.
    engine_check_kwargs=dict(max_num_seqs=64, max_model_len=2048, gpu_memory_utilization=0.3),
    # Half the memory: the real sizing path (warm-up, graph reserve), and room left for the other side.
    graph_kwargs=dict(max_num_seqs=256, max_model_len=2048, gpu_memory_utilization=0.5),
)
# bf16 is computed wrongly by the interpreter: the dry run checks float32 in its place.
DRY = Plan(
    device="cpu",
    dtypes=["float32", "float16"],
    check_max_len=48,  # the interpreter: 100 took 50 s a dtype
    check_batch=3,
    decode_dtype="float16",
    decode_batches=[2],
    decode_contexts=[64, 208],
    split_sweep=[1, 4],
    copy_mib=64,
    prefill_batch=1,
    prefill_len=64,
    fused_tokens=[4, 16],
    model=TINY,
    model_dtype="float32",
    requests=4,
    len_range=(5, 20),
    budget_s=1000.0,  # the interpreter on 2 shared cores: slow, and slower under load
    graph_batches=[1, 3],
    graph_context=12,
    graph_steps=2,
    graph_budget_s=60.0,
    engine_budget_s=300.0,
    logit_len=20,
    small_new_tokens=6,
    small_max_prompt=20,
    engine_kwargs=dict(max_num_seqs=4, max_model_len=64, kv_cache_memory=16 << 20),
    # Padded decode runs eagerly on CPU: the graph-vs-eager rows compare that path with itself there.
    engine_check_kwargs=dict(max_num_seqs=4, max_model_len=64, kv_cache_memory=16 << 20, pad_decode=True),
    # PyTorch attention: the padded path through the interpreted kernels is a test of its own.
    graph_kwargs=dict(max_num_seqs=4, max_model_len=64, kv_cache_memory=16 << 20, attention_backend="torch"),
    # Left to size itself on CPU, transformers' cache takes most of the host's free memory.
    hf_batching=dict(num_blocks=16, max_batch_tokens=256),
)

Row = tuple[str, str, str, str]  # section, item, result, detail
SECTIONS = ("correctness", "decode", "prefill", "fused", "engine", "tp", "graphs", "e2e")
JUDGED = ("correctness", "fused", "engine", "tp")  # the exit code is 1 when one of these fails
JSONL = "gpu_check.jsonl"


class Reporter:
    """Rows as they are made: printed at once (flushed) and appended to a JSON-lines file, so nothing is
    lost to a time limit; ``append`` takes a Row, as the list it replaces did."""

    def __init__(self, path: Path | None) -> None:
        self.rows: Reporter = []
        self.path = path
        self.start = time.monotonic()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, row: Row, **data: Any) -> None:
        self.rows.append(row)
        print("ROW " + " | ".join(row), flush=True)
        if self.path is not None:
            record = dict(zip(("section", "item", "result", "detail"), row, strict=True))
            record.update(data, t_s=round(time.monotonic() - self.start, 1))
            with self.path.open("a") as f:
                f.write(json.dumps(record, default=str) + "\n")

    def __iter__(self) -> Any:
        return iter(self.rows)


# ---- timing -----------------------------------------------------------------------------------------


def time_ms(fn: Callable[[], Any], device: str) -> float:
    """Median milliseconds per call; on the GPU with triton's do_bench, which flushes L2 between calls so
    that a bandwidth figure is not a cache figure."""
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))
    fn()  # the interpreter is slow: one warm call and one timed call say enough on CPU
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3
