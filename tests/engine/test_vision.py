"""Images in chat requests to vision-language models: greedy tokens identical to transformers' generate on
the same images and prompts (float32, CPU), in a mixed batch of text-only and image requests under
preemption and chunked prefill; the encoder's cache; prefix caching keyed by image content."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import fresh_seed
from sluice.engine.linear import onednn_supports
from sluice.engine.llm import LLM
from sluice.engine.outputs import Completion, Request
from sluice.engine.sampling_params import SamplingParams
from vision_helpers import data_url, make_tiny_idefics3, make_tiny_llava, random_image

MAX_NEW = 24
BLOCK = 16
WORDS = "a photo of the red cat on a blue mat with green dogs and yellow birds near the old tree".split()


def _kv_bytes(text_config: Any, num_blocks: int) -> int:
    head_dim = text_config.hidden_size // text_config.num_attention_heads
    return num_blocks * text_config.num_hidden_layers * 2 * BLOCK * text_config.num_key_value_heads * head_dim * 4


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _content(parts: list[Any], as_url: bool) -> list[dict[str, Any]]:
    """Chat content parts: strings are text, PIL images are image parts (a data: URL for the engine, the image
    itself for transformers' processor)."""
    out: list[dict[str, Any]] = []
    for p in parts:
        if isinstance(p, str):
            out.append({"type": "text", "text": p})
        else:
            out.append({"type": "image", "url": data_url(p)} if as_url else {"type": "image", "image": p})
    return out


def _messages(turns: list[tuple[str, Any]], as_url: bool) -> list[dict[str, Any]]:
    return [{"role": role, "content": c if isinstance(c, str) else _content(c, as_url)} for role, c in turns]


class Reference:
    """transformers' own processor and generate on a saved model: the reference."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()

    def inputs(self, turns: list[tuple[str, Any]]) -> dict[str, Any]:
        return self.processor.apply_chat_template(_messages(turns, as_url=False), add_generation_prompt=True,
                                                  tokenize=True, return_dict=True, return_tensors="pt")

    def greedy(self, turns: list[tuple[str, Any]], max_new: int = MAX_NEW) -> tuple[list[int], list[int]]:
        enc = self.inputs(turns)
        out = self.hf.generate(**enc, max_new_tokens=max_new, do_sample=False)
        n = enc["input_ids"].shape[1]
        return enc["input_ids"][0].tolist(), out[0, n:].tolist()

    def assert_matches(self, turns: list[tuple[str, Any]], c: Completion, tol: float = 1e-4) -> None:
        """Token-identical, or else the first difference is a genuine near-tie in the reference's logits."""
        prompt, ref = self.greedy(turns)
        assert c.error is None, c.error
        assert c.prompt_token_ids == prompt
        ours = c.token_ids
        if ours == ref:
            return
        t = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), min(len(ours), len(ref)))
        assert t < min(len(ours), len(ref)), f"lengths differ without a differing token: {len(ours)} vs {len(ref)}"
        enc = self.inputs(turns)
        ids = torch.tensor([prompt + ref[:t]])
        with torch.no_grad():
            logits = self.hf(input_ids=ids, attention_mask=torch.ones_like(ids),
                             **{k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}).logits
        row = logits[0, -1].double()
        gap = abs(float(row[ours[t]] - row[ref[t]]))
        assert gap <= tol, f"token {t} differs: ours {ours[t]} vs {ref[t]}, logit gap {gap:.3g}\nours={ours}\nref ={ref}"


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Reference]:
    path = make_tiny_llava(tmp_path_factory.mktemp("llava") / "m", seed=1)
    return path, Reference(path)


@pytest.fixture(scope="module")
def idefics3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Reference]:
    path = make_tiny_idefics3(tmp_path_factory.mktemp("idefics3") / "m", seed=1)
    return path, Reference(path)


def _request(rid: str, turns: list[tuple[str, Any]], max_new: int = MAX_NEW) -> Request:
    return Request(rid, messages=_messages(turns, as_url=True), params=SamplingParams(max_tokens=max_new))


def _lines(rng: random.Random) -> list[list[tuple[str, Any]]]:
    """Text-only and image chats: one image, two images, an image repeated in another line, a system turn."""
    a, b, c = (random_image(rng, rng.randint(30, 90), rng.randint(30, 90)) for _ in range(3))
    return [
        [("user", [a, _text(rng, 6)])],
        [("user", _text(rng, 12))],
        [("system", _text(rng, 10)), ("user", [_text(rng, 3), b, _text(rng, 4), c])],
        [("user", [a, _text(rng, 9)])],
        [("user", [_text(rng, 5)])],
        [("user", [c, _text(rng, 2)])],
    ]


@pytest.mark.parametrize("arch", ["llava", "idefics3"])
def test_matches_generate_under_preemption_and_chunked_prefill(arch: str, request: pytest.FixtureRequest) -> None:
    """Six lines in one run on a cache too small for them (preemption) with a 24-token step budget (prefill
    chunks that cut images apart): each line's tokens are transformers' own; each image is encoded once.
    Idefics3 splits each image into tiles: many image-token runs per image, between text tokens."""
    path, ref = request.getfixturevalue(arch)
    lines = _lines(random.Random(fresh_seed()))
    text_config = ref.hf.config.get_text_config()
    llm = LLM(str(path), dtype="float32", kv_cache_memory=_kv_bytes(text_config, 14), max_num_batched_tokens=24,
              max_num_seqs=6, block_size=BLOCK)
    assert llm.model_impl == "transformers" and llm.vision is not None
    if arch == "idefics3" and onednn_supports(torch.float32):  # its SigLIP tower's tanh GELU runs fused in oneDNN
        fc1 = type(llm.vision.hf.model.vision_model.encoder.layers[0].mlp.fc1).__name__
        assert fc1 == "PackedDenseGelu", fc1
    outs = llm.generate([_request(f"r{i}", t) for i, t in enumerate(lines)])
    for turns, c in zip(lines, outs, strict=True):
        ref.assert_matches(turns, c)
    assert llm.stats["preemptions"] > 0
    assert llm.stats["images_encoded"] == 3  # a, b, c: image a's second line and every recompute hit the cache
    assert llm.num_free_blocks == llm.num_total_blocks
    assert all(c.usage.prompt_tokens == len(c.prompt_token_ids) for c in outs)  # image tokens counted


def test_prefix_cache_is_keyed_by_image_content(llava: tuple[Path, Reference]) -> None:
    """The same image and text share their KV; another image behind the same placeholder tokens shares only
    the blocks before it. Each line's tokens stay transformers' own."""
    path, ref = llava
    rng = random.Random(fresh_seed())
    a, b = random_image(rng, 64, 48), random_image(rng, 40, 70)
    system = ("system", _text(rng, 30))  # two blocks and more before the image
    first = [system, ("user", [a, "describe it"])]
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK)
    assert llm.vision is not None
    (c1,) = llm.generate([_request("first", first)])
    ref.assert_matches(first, c1)
    assert c1.usage.cached_tokens == 0 and llm.stats["images_encoded"] == 1

    same = [system, ("user", [a, "describe it"])]
    (c2,) = llm.generate([_request("same", same)])
    ref.assert_matches(same, c2)
    assert c2.usage.cached_tokens == (len(c2.prompt_token_ids) - 1) // BLOCK * BLOCK  # all but the last block
    assert llm.stats["images_encoded"] == 1  # its tokens' KV came from the cache: not even the encoder ran

    moved = [("system", _text(rng, 5)), ("user", [a, "describe it"])]  # no shared prefix, the same image
    (c4,) = llm.generate([_request("moved", moved)])
    ref.assert_matches(moved, c4)
    assert llm.stats["images_encoded"] == 1 and llm.stats["image_cache_hits"] == 1

    other = [system, ("user", [b, "describe it"])]
    (c3,) = llm.generate([_request("other", other)])
    ref.assert_matches(other, c3)
    first_image = c3.prompt_token_ids.index(llm.vision.image_token_id)
    assert c3.prompt_token_ids == c1.prompt_token_ids  # the same tokens: only the image differs
    assert c3.usage.cached_tokens == first_image // BLOCK * BLOCK > 0  # the blocks before the image alone
    assert llm.stats["images_encoded"] == 2


def test_n_samples_share_one_encoding(llava: tuple[Path, Reference]) -> None:
    path, _ = llava
    img = random_image(random.Random(fresh_seed()), 50, 50)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK)
    req = Request("n", messages=_messages([("user", [img, "hi"])], as_url=True),
                  params=SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=1))
    (c,) = llm.generate([req])
    assert c.error is None and len(c.outputs) == 3
    assert llm.stats["images_encoded"] == 1


class _CountingProcessor:
    """A processor that counts its calls and otherwise is the one it wraps."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_one_image_line_is_processed_once_and_two_per_image(idefics3: tuple[Path, Reference]) -> None:
    """A one-image line's prompt and encoder inputs come from one processor call (its image processing is
    most of a line's CPU time outside the model); a line with two images processes each alone too."""
    path, ref = idefics3
    seed = fresh_seed()
    rng = random.Random(seed)
    a, b = (random_image(rng, rng.randint(30, 90), rng.randint(30, 90)) for _ in range(2))
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK)
    assert llm.vision is not None
    counting = _CountingProcessor(llm.vision.processor)
    llm.vision.processor = counting
    one, two = [("user", [a, "what is it?"])], [("user", [a, "and", b])]
    c1, c2 = llm.generate([_request("one", one, max_new=4), _request("two", two, max_new=4)])
    assert counting.calls == 1 + 3, f"seed {seed}"
    for turns, c in ((one, c1), (two, c2)):
        assert c.error is None, c.error
        assert c.prompt_token_ids == ref.greedy(turns, max_new=1)[0], f"seed {seed}"


def test_tower_layers_get_contiguous_hidden_states(idefics3: tuple[Path, Reference]) -> None:
    """SigLIP-style patch embeddings are a transposed view; the tower's first LayerNorm sees them contiguous
    (else every LayerNorm of every layer copies its input first)."""
    path, _ = idefics3
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK)
    assert llm.vision is not None
    seen: list[bool] = []
    layer = llm.vision.hf.model.vision_model.encoder.layers[0]
    layer.layer_norm1.register_forward_pre_hook(lambda _m, args: seen.append(args[0].is_contiguous()))
    img = random_image(random.Random(fresh_seed()), 60, 40)
    (c,) = llm.generate([_request("r", [("user", [img, "hi"])], max_new=2)])
    assert c.error is None, c.error
    assert seen and all(seen)


def test_image_lines_render_in_bursts_on_threads_a_few_ahead_and_a_bad_one_fails_alone(
        idefics3: tuple[Path, Reference]) -> None:
    """Image lines added one at a time (as the queue worker adds them) are not rendered when they arrive:
    each step renders the next few on a thread per core, at most ``ahead`` past the scheduler (a rendered
    line holds its pixels until encoded). The prompts are the processor's, a corrupt image fails its line
    only, a line aborted before rendering never renders, and a second line of a waiting line's id is refused."""
    import threading

    path, ref = idefics3
    seed = fresh_seed()
    rng = random.Random(seed)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK)
    assert llm.vision is not None
    threads: list[str] = []
    render = llm.vision.prompt

    def recording(request: Request) -> Any:
        threads.append(threading.current_thread().name)
        return render(request)

    llm.vision.prompt = recording  # type: ignore[method-assign]
    n = llm.unrendered.ahead + 4
    good = [[("user", [random_image(rng, rng.randint(30, 90), rng.randint(30, 90)), _text(rng, 4)])] for _ in range(n)]
    corrupt = Request("bad", params=SamplingParams(max_tokens=2), messages=[
        {"role": "user", "content": [{"type": "image", "url": "data:image/png;base64,aGVsbG8="}, {"type": "text", "text": "x"}]}])
    reqs = [_request(f"g{i}", t, max_new=2) for i, t in enumerate(good)]
    for r in [reqs[0], corrupt, *reqs[1:], _request("gone", good[0], max_new=2)]:
        llm.add_request(r)
    assert threads == [] and llm.num_waiting == n + 2, seed
    llm.add_request(_request("g3", good[3], max_new=2))  # the id of a line still waiting to render
    aborted = llm.abort("gone")
    assert aborted is not None and [o.finish_reason for o in aborted.outputs] == ["abort"], aborted
    done = {c.request_id: c for c in llm.step()}
    assert len(threads) == llm.unrendered.ahead, (len(threads), seed)  # a burst, not every line
    assert "already in flight" in (done["g3"].error or ""), done
    while llm.has_unfinished():
        done.update((c.request_id, c) for c in llm.step())
    assert len(threads) == n + 1, seed  # each line once, the aborted one never
    assert len(set(threads)) >= 2 or torch.get_num_threads() < 2, set(threads)
    assert all(t.startswith("sluice-render") for t in threads), set(threads)
    for i, turns in enumerate(good):
        c = done[f"g{i}"]
        assert c.error is None, (c.error, seed)
        assert c.prompt_token_ids == ref.greedy(turns, max_new=1)[0], f"seed {seed}"
    assert done["bad"].error is not None and "image" in done["bad"].error.lower(), done["bad"].error
    assert llm.generate([_request("again", good[0], max_new=2)])[0].prompt_token_ids == done["g0"].prompt_token_ids


@pytest.mark.parametrize("arch", ["llava", "idefics3"])
def test_a_literal_image_token_in_a_one_image_line_fails_that_line(arch: str, request: pytest.FixtureRequest) -> None:
    """A one-image line's image takes every image token of its prompt: text that spells the image token
    (a second placeholder) must fail that line with a clear error, not reach the encoder; the other line runs."""
    path, _ = request.getfixturevalue(arch)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=8 << 20, block_size=BLOCK)
    assert llm.vision is not None
    img = random_image(random.Random(fresh_seed()), 40, 40)
    bad = _request("bad", [("user", [img, f"look {llm.vision.image_token} here"])], max_new=2)
    good = _request("good", [("user", [img, "hi"])], max_new=2)
    b, g = llm.generate([bad, good])
    assert b.error is not None and "image" in b.error, b.error
    assert g.error is None, g.error
    assert llm.stats["images_encoded"] == 1
