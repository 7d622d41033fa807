"""The transformers-backed model path: greedy output token-identical to transformers' own generate
(float32, CPU) for each architecture, with the engine's preemption, chunked prefill and prefix caching
all at work in one run, and prompts longer than the sliding windows of the models that have one."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_greedy_matches, fresh_seed, hf_greedy, make_tiny_model, random_prompts
from sluice.engine.llm import LLM
from sluice.engine.models.base import UnsupportedModelError
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from transformers import AutoModelForCausalLM

WINDOW = 12  # shorter than every prompt below
ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
    "gemma2-softcap-window": dict(model_type="gemma2", head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                                  attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3-text-local-global": dict(model_type="gemma3_text", head_dim=16, sliding_window=WINDOW,
                                     layer_types=["sliding_attention", "full_attention"]),
    "phi3-window": dict(model_type="phi3", sliding_window=WINDOW, pad_token_id=0),
    "olmo2": dict(model_type="olmo2"),
    "mixtral-moe": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen3-moe": dict(model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "granite-multipliers": dict(model_type="granite", logits_scaling=2.0, attention_multiplier=0.2,
                                residual_multiplier=0.5, embedding_multiplier=2.0),
    "gpt-neox": dict(model_type="gpt_neox", num_attention_heads=2),
}
MAX_NEW = 30  # growth of two blocks and more a sequence, so running sequences must outgrow the cache
NUM_BLOCKS = 6  # of 16 tokens, for 6 sequences of 56-66 tokens sharing 2 blocks: the cache must overflow


def _tiny(tmp_path_factory: pytest.TempPathFactory, name: str, **cfg: Any) -> tuple[Path, Any]:
    path = make_tiny_model(tmp_path_factory.mktemp(name) / "m", seed=1, **cfg)
    # eager: the reference that applies every model's soft-capping in every transformers version (5.17 ran
    # Gemma 2 on SDPA, which skips it; the GPU image has 5.17)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _kv_bytes(config: Any, num_blocks: int) -> int:
    """Bytes for ``num_blocks`` in float32 (these configs have the same K/V shape in every layer)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return num_blocks * config.num_hidden_layers * 2 * 16 * heads * head_dim * 4


def _generate(llm: LLM, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=max_new)) for i, p in enumerate(prompts)]
    outs = llm.generate(reqs)
    assert all(c.error is None for c in outs), [c.error for c in outs]
    return [c.token_ids for c in outs]


def _shared_prefix_prompts(rng: random.Random) -> list[list[int]]:
    system = random_prompts(rng, 1, 2 * WINDOW + 8, 2 * WINDOW + 8)[0]  # two whole blocks, shared
    return [system + tail for tail in random_prompts(rng, 6, 14, 24)]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_transformers_path_matches_generate(arch: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Preemption (a cache too small for the batch), chunked prefill (a 24-token step budget) and prefix
    caching (a shared 32-token system prompt) in one run; every prompt is longer than WINDOW."""
    path, hf = _tiny(tmp_path_factory, arch, **ARCHS[arch])
    rng = random.Random(fresh_seed())
    prompts = _shared_prefix_prompts(rng)
    llm = LLM(str(path), dtype="float32", model_impl="transformers", kv_cache_memory=_kv_bytes(hf.config, NUM_BLOCKS),
              max_num_batched_tokens=24, max_num_seqs=6, block_size=16)
    assert llm.model_impl == "transformers" and llm.num_total_blocks == NUM_BLOCKS
    for p, ours in zip(prompts, _generate(llm, prompts), strict=True):
        assert_greedy_matches(hf, p, ours, hf_greedy(hf, p, MAX_NEW))
    assert llm.stats["preemptions"] > 0
    assert llm.stats["prefix_cache_hit_tokens"] > 0
    assert llm.num_free_blocks == llm.num_total_blocks


def test_qwen2_moe_matches_generate(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen2-MoE's shared expert and its gate, on a plain mixed batch."""
    path, hf = _tiny(tmp_path_factory, "qwen2moe", model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=32, shared_expert_intermediate_size=64)
    prompts = random_prompts(random.Random(fresh_seed()), 4, 1, 40)
    llm = LLM(str(path), dtype="float32", model_impl="transformers", kv_cache_memory=8 << 20)
    for p, ours in zip(prompts, _generate(llm, prompts), strict=True):
        assert_greedy_matches(hf, p, ours, hf_greedy(hf, p, MAX_NEW))


def test_native_and_transformers_paths_agree_on_llama(tmp_path_factory: pytest.TempPathFactory) -> None:
    path, hf = _tiny(tmp_path_factory, "llama-both", model_type="llama")
    prompts = random_prompts(random.Random(fresh_seed()), 6, 1, 60)
    native = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20)
    assert native.model_impl == "native"  # auto picks the fast path where it exists
    via_hf = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, model_impl="transformers")
    assert _generate(native, prompts, 16) == _generate(via_hf, prompts, 16)


def test_native_qwen3_matches_generate(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The native fast path's q/k norm (Qwen3), under a small step budget so prompts are chunked."""
    path, hf = _tiny(tmp_path_factory, "qwen3-native", model_type="qwen3", head_dim=16)
    prompts = random_prompts(random.Random(fresh_seed()), 6, 1, 60)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, max_num_batched_tokens=16)
    assert llm.model_impl == "native"
    for p, ours in zip(prompts, _generate(llm, prompts, 16), strict=True):
        assert_greedy_matches(hf, p, ours, hf_greedy(hf, p, 16))


def test_auto_picks_transformers_where_no_native_path_exists(tmp_path_factory: pytest.TempPathFactory) -> None:
    path, _ = _tiny(tmp_path_factory, "olmo2-auto", model_type="olmo2", num_hidden_layers=1)
    assert LLM(str(path), dtype="float32", kv_cache_memory=1 << 20).model_impl == "transformers"
    with pytest.raises(UnsupportedModelError, match="no native implementation of 'olmo2'"):
        LLM(str(path), dtype="float32", kv_cache_memory=1 << 20, model_impl="native")


def test_attention_that_ignores_the_interface_is_refused(tmp_path_factory: pytest.TempPathFactory) -> None:
    """StableLM's attention does not hand forward kwargs to the attention function: refused at load, by name."""
    path, _ = _tiny(tmp_path_factory, "stablelm", model_type="stablelm", num_hidden_layers=1)
    with pytest.raises(UnsupportedModelError, match="StableLmAttention does not pass forward kwargs"):
        LLM(str(path), dtype="float32", kv_cache_memory=1 << 20, model_impl="transformers")


def test_encoder_decoder_is_refused_before_loading_weights(tmp_path: Path) -> None:
    from transformers import T5Config

    T5Config(vocab_size=100, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="^t5 is an encoder-decoder model; Sluice runs decoder-only") as e:
        LLM(str(tmp_path), dtype="float32")
    assert "\n" not in str(e.value)


def test_triton_backend_on_the_transformers_path(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 2's sliding window and soft-capping through the Triton kernels (interpreted), chunked prompts."""
    path, hf = _tiny(tmp_path_factory, "gemma2-triton", **ARCHS["gemma2-softcap-window"])
    prompts = random_prompts(random.Random(fresh_seed()), 3, WINDOW + 1, 40)
    llm = LLM(str(path), dtype="float32", model_impl="transformers", attention_backend="triton",
              kv_cache_memory=4 << 20, max_num_batched_tokens=32)
    for p, ours in zip(prompts, _generate(llm, prompts, 6), strict=True):
        assert_greedy_matches(hf, p, ours, hf_greedy(hf, p, 6))


@pytest.mark.parametrize("command", ["generate", "worker"])
def test_cli_refuses_an_encoder_decoder_in_one_line(command: str, tmp_path: Path) -> None:
    """``sluice generate`` and ``sluice worker`` (which checks its job server first: one is started) exit 1
    with the reason on one line, no traceback."""
    from cli_api_helpers import sluice_home
    from click.testing import CliRunner
    from sluice.cli.common import EXIT_USER_ERROR
    from sluice.cli.main import cli
    from transformers import BartConfig

    BartConfig(vocab_size=100, d_model=16, encoder_layers=1, decoder_layers=1).save_pretrained(tmp_path / "bart")
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    args = {"generate": [str(src), "-o", str(tmp_path / "out.jsonl")], "worker": ["--exit-when-idle", "0"]}[command]
    with sluice_home(tmp_path / "home"):
        res = CliRunner().invoke(cli, [command, *args, "--model", str(tmp_path / "bart"), "--model-impl", "transformers"])
    assert res.exit_code == EXIT_USER_ERROR, res.output
    assert isinstance(res.exception, SystemExit), res.exception
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "bart is an encoder-decoder model; Sluice runs decoder-only" in lines[0], res.stderr


def _queued(r: Any, queue: str, n: int) -> Any:
    from sluice.jobs.submit import submit

    return submit([json.dumps({"custom_id": f"j{i}", "prompt": f"p {i}", "priority": i % 2}) for i in range(n)],
                  r=r, model=queue)


def _left(r: Any, batch_id: str) -> int:
    """Entries still in the batch's job streams, delivered (pending) or not."""
    from sluice.jobs import keys
    from sluice.jobs.store import priorities

    return sum(r.xlen(keys.jobs(batch_id, p)) for p in priorities(r, batch_id))


def _refusing_worker(model: Path, *args: str) -> Any:
    from click.testing import CliRunner
    from sluice.cli.main import cli

    return CliRunner().invoke(cli, ["worker", "--model", str(model), "--exit-when-idle", "0", *args])


def test_a_refused_worker_fails_the_jobs_waiting_for_its_model(tmp_path: Path) -> None:
    """``sluice worker`` on an encoder-decoder exits 1 as before, and first gives each job queued for it,
    new or left pending by a dead worker, one failed outcome naming the architecture: the batch completes."""
    from cli_api_helpers import sluice_home
    from jobs_helpers import assert_exactly_once
    from sluice.jobs.connection import connect
    from sluice.jobs.consumer import commands as consumer
    from sluice.jobs.store import get_batch, queue_depth
    from transformers import T5Config

    model = tmp_path / "t5"
    T5Config(vocab_size=100, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8).save_pretrained(model)
    with sluice_home(tmp_path / "home"):
        r = connect()
        batch = _queued(r, str(model), 5)
        orphan = consumer.read(r, str(model), "dead-worker", 1, consumer.ready(r, str(model)))  # no heartbeat
        assert len(orphan.deliveries) == 1
        res = _refusing_worker(model)
        assert res.exit_code == 1 and isinstance(res.exception, SystemExit), res.output
        assert "t5 is an encoder-decoder model" in res.stderr.strip().splitlines()[-1], res.stderr
        for e in assert_exactly_once(r, batch.id, 5):
            assert e["status"] == "failed" and e["error"]["code"] == "unsupported_model", e
            assert e["error"]["message"].startswith("t5 is an encoder-decoder model; Sluice runs decoder-only"), e
        assert get_batch(r, batch.id).status == "completed"
        assert _left(r, batch.id) == 0 and queue_depth(r, str(model)) == 0
        assert _refusing_worker(model).exit_code == 1  # again: nothing left to fail, nothing written twice
        assert_exactly_once(r, batch.id, 5)


def test_a_refused_worker_leaves_the_jobs_of_a_queue_a_live_worker_serves(tmp_path: Path) -> None:
    """A misconfigured worker on a shared ``--queue``: the live worker there may run the jobs, so they stay."""
    from cli_api_helpers import sluice_home
    from sluice.jobs.connection import connect
    from sluice.jobs.consumer import commands as consumer
    from sluice.jobs.store import get_batch, queue_depth
    from transformers import BartConfig

    model = tmp_path / "bart"
    BartConfig(vocab_size=100, d_model=16, encoder_layers=1, decoder_layers=1).save_pretrained(model)
    with sluice_home(tmp_path / "home"):
        r = connect()
        batch = _queued(r, "shared", 3)
        assert consumer.claim_identity(r, "live", json.dumps({"id": "live", "queue": "shared"}), 60_000)
        assert _refusing_worker(model, "--queue", "shared").exit_code == 1
        assert queue_depth(r, "shared") == 3 and _left(r, batch.id) == 3
        assert get_batch(r, batch.id).status == "in_progress"


def test_kv_cache_is_sized_and_allocated_per_layer() -> None:
    """Layers that keep different K/V shapes (Gemma 3n, OpenELM) each get their own; one block id
    means the same block in every layer."""
    from sluice.engine.attention import LayerKVSpec
    from sluice.engine.model_runner import allocate_kv_caches, kv_bytes_per_block

    spec = [LayerKVSpec(2, 16), LayerKVSpec(1, 64), LayerKVSpec(4, 8)]
    assert kv_bytes_per_block(spec, 16, torch.bfloat16) == 2 * 16 * (32 + 64 + 32) * 2
    caches = allocate_kv_caches(spec, 5, 16, torch.float32, torch.device("cpu"))
    assert [tuple(k.shape) for k, _ in caches] == [(5, 16, 2, 16), (5, 16, 1, 64), (5, 16, 4, 8)]
    assert all(k.shape == v.shape and k.data_ptr() != v.data_ptr() for k, v in caches)
