"""Qwen2-VL and Qwen2.5-VL (M-RoPE: three position rows per token) on tiny random models: greedy tokens
identical to transformers' generate on the same images and prompts (float32, CPU), in a mixed batch with
text-only lines, under preemption and chunked prefill, with two images in a prompt and images of other
sizes; the positions table against transformers' get_rope_index; the encoder's cache and prefix sharing."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import fresh_seed
from sluice.engine.llm import LLM
from sluice.engine.mrope import prompt_positions
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams
from test_vision import BLOCK, Reference, _kv_bytes, _messages, _request, _text
from vision_helpers import make_tiny_qwen2vl, random_image

VERSIONS = ["2", "2.5"]


class QwenReference(Reference):
    """transformers' generate; the processor loads without torchvision (engine/vision_processor.py)."""

    def __init__(self, path: Path) -> None:
        from sluice.engine.vision_processor import load_processor
        from transformers import AutoModelForImageTextToText

        self.processor = load_processor(str(path))
        self.hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=VERSIONS, ids=lambda v: f"qwen{v}-vl")
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, QwenReference]:
    path = make_tiny_qwen2vl(tmp_path_factory.mktemp("qwenvl") / "m", seed=1, version=request.param)
    return path, QwenReference(path)


def _size(rng: random.Random) -> tuple[int, int]:
    """Wide, tall and square images: their grids differ in shape, so the h/w rows differ."""
    return rng.choice([(rng.randint(30, 50), rng.randint(60, 90)), (rng.randint(60, 90), rng.randint(30, 50)),
                       (rng.randint(40, 70),) * 2])


def _lines(rng: random.Random) -> list[list[tuple[str, Any]]]:
    a, b, c = (random_image(rng, *_size(rng)) for _ in range(3))
    return [
        [("user", [a, _text(rng, 6)])],
        [("user", _text(rng, 12))],
        [("system", _text(rng, 10)), ("user", [_text(rng, 3), b, _text(rng, 4), c])],
        [("user", [a, _text(rng, 9)])],
        [("user", [_text(rng, 5)])],
        [("user", [c, b, _text(rng, 2)])],  # two images side by side
    ]


def test_positions_match_get_rope_index(qwen: tuple[Path, QwenReference]) -> None:
    """The engine's table and delta are transformers' own, for prompts with one and two images."""
    path, ref = qwen
    rng = random.Random(fresh_seed())
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK)
    assert llm.vision is not None and llm.vision.mrope
    for turns in _lines(rng):
        enc = ref.inputs(turns)
        ids = enc["input_ids"][0].tolist()
        _, items = llm.vision.prompt(_request("p", turns))
        table = llm.vision.rope_positions(ids, items)
        if "image_grid_thw" not in enc:
            assert table is None
            continue
        want, delta = ref.hf.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"], enc["image_grid_thw"])
        assert table is not None
        np.testing.assert_array_equal(table.table, want[:, 0].numpy())
        assert table.delta == int(delta) < 0


def test_prompt_positions_text_runs_on_after_the_grid() -> None:
    """A 2x3 image after two text tokens: its rows are the grid offset by 2; text resumes at 2 + 3."""
    m = prompt_positions(10, [(2, 6, (1, 2, 3))])
    np.testing.assert_array_equal(m.table, [[0, 1, 2, 2, 2, 2, 2, 2, 5, 6],
                                            [0, 1, 2, 2, 2, 3, 3, 3, 5, 6],
                                            [0, 1, 2, 3, 4, 2, 3, 4, 5, 6]])
    assert m.delta == 7 - 10
    np.testing.assert_array_equal(m.rows(8, 12), [[5, 6, 7, 8]] * 3)  # decode positions: index + delta
    with pytest.raises(ValueError, match="grid"):
        prompt_positions(10, [(2, 5, (1, 2, 3))])


@pytest.mark.parametrize("pad_decode", [False, True], ids=["eager", "padded-decode"])
def test_matches_generate_under_preemption_and_chunked_prefill(qwen: tuple[Path, QwenReference],
                                                               pad_decode: bool) -> None:
    """Six lines in one run on a cache too small for them (preemption) with a 24-token step budget (prefill
    chunks that cut images and their position grids apart): each line's tokens are transformers' own, each
    image encoded once. ``pad_decode``: decode steps go through the decode graph runner's static inputs,
    where a decode token's one position is its index + the sequence's delta."""
    path, ref = qwen
    lines = _lines(random.Random(fresh_seed()))
    text_config = ref.hf.config.get_text_config()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=_kv_bytes(text_config, 14), max_num_batched_tokens=24,
              max_num_seqs=6, block_size=BLOCK, pad_decode=pad_decode)
    assert llm.model_impl == "transformers" and llm.vision is not None
    outs = llm.generate([_request(f"r{i}", t) for i, t in enumerate(lines)])
    for turns, c in zip(lines, outs, strict=True):
        ref.assert_matches(turns, c)
    assert llm.stats["preemptions"] > 0
    assert llm.stats["images_encoded"] == 3  # a, b, c: repeats and every recompute hit the cache
    assert llm.num_free_blocks == llm.num_total_blocks
    assert all(c.usage.prompt_tokens == len(c.prompt_token_ids) for c in outs)
    if pad_decode:
        assert llm.runner.decode_runner is not None and sum(llm.runner.decode_runner.steps.values()) > 0


def test_prefix_cache_and_n_samples(qwen: tuple[Path, QwenReference]) -> None:
    """Two lines with the same image and text share their KV (and the second encodes nothing); the same tokens
    over another image share only the blocks before it; n samples share one encoding and one table."""
    path, ref = qwen
    rng = random.Random(fresh_seed())
    a, b = random_image(rng, 64, 48), random_image(rng, 48, 64)  # the same token count, transposed grids
    system = ("system", _text(rng, 30))
    first = [system, ("user", [a, "describe it"])]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK)
    assert llm.vision is not None
    (c1,) = llm.generate([_request("first", first)])
    ref.assert_matches(first, c1)
    (c2,) = llm.generate([_request("same", [system, ("user", [a, "describe it"])])])
    ref.assert_matches(first, c2)
    assert c2.usage.cached_tokens == (len(c2.prompt_token_ids) - 1) // BLOCK * BLOCK
    assert llm.stats["images_encoded"] == 1

    other = [system, ("user", [b, "describe it"])]
    (c3,) = llm.generate([_request("other", other)])
    ref.assert_matches(other, c3)
    assert c3.prompt_token_ids == c1.prompt_token_ids  # the same tokens: only the image (and its grid) differs
    first_image = c3.prompt_token_ids.index(llm.vision.image_token_id)
    assert c3.usage.cached_tokens == first_image // BLOCK * BLOCK > 0
    assert llm.stats["images_encoded"] == 2

    req = Request("n", messages=_messages([("user", [a, "hi"])], as_url=True),
                  params=SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=1))
    (c,) = llm.generate([req])
    assert c.error is None and len(c.outputs) == 3
    assert llm.stats["images_encoded"] == 2 and llm.num_free_blocks == llm.num_total_blocks
