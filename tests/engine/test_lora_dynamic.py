"""LoRA adapters loaded when a request names them (issue 46, item 2): looked up under the engine's adapter roots,
kept in ``max_loras`` slots and a larger CPU cache, evicted when unused and read again when named again;
every output token-identical to peft with the adapter merged into the base. A name can never reach outside
the roots; a corrupt or mismatched adapter fails its own requests only."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_greedy_matches, fresh_seed, hf_greedy, make_tiny_model, random_prompts
from lora_helpers import make_adapter, merged_model
from sluice.engine.llm import LLM
from sluice.engine.lora.adapters import LoraError
from sluice.engine.lora.sources import check_adapter_name
from sluice.engine.outputs import Completion, Request
from sluice.engine.sampling_params import SamplingParams
from transformers import AutoModelForCausalLM

pytest.importorskip("peft")
pytest_plugins = ["s3_fixtures"]

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
BASES = {
    "llama": dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", head_dim=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
}
MAX_NEW = 8


def _spec(rng: random.Random) -> dict[str, Any]:
    """A random adapter's rank, alpha and targets (some under rslora)."""
    targets = rng.sample(ATTN + MLP, rng.randint(1, 7))
    return dict(r=rng.choice([2, 4, 8]), targets=targets, alpha=rng.choice([4.0, 8.0, 16.0]), rslora=rng.random() < 0.3)


class Roots:
    """A tiny base and ``n`` random adapters saved by peft under one adapter root (``root/a<i>``)."""

    def __init__(self, where: Path, kind: str, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.base = make_tiny_model(where / "base", seed=3, **BASES[kind])
        self.root = where / "adapters"
        self.names = [f"a{i}" for i in range(n)]
        for i, name in enumerate(self.names):
            make_adapter(self.base, self.root / name, seed=seed + i, **_spec(rng))
        self.base_ref = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32).eval()

    def llm(self, **config: Any) -> LLM:
        config.setdefault("kv_cache_memory", 16 << 20)
        return LLM(str(self.base), dtype="float32", lora_roots=[str(self.root)], **config)

    def check(self, rows: list[tuple[str | None, list[int]]], done: list[Completion], max_new: int = MAX_NEW) -> None:
        """Each row's tokens are peft's greedy ones with its adapter merged (one merged model at a time)."""
        for name in dict.fromkeys(n for n, _ in rows):
            ref = self.base_ref if name is None else merged_model(self.base, self.root / name)
            for (n, p), c in zip(rows, done, strict=True):
                if n == name:
                    assert c.error is None, c.error
                    assert_greedy_matches(ref, p, c.token_ids, hf_greedy(ref, p, max_new))


def _requests(rows: list[tuple[str | None, list[int]]], max_new: int = MAX_NEW) -> list[Request]:
    return [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=max_new), lora=name)
            for i, (name, p) in enumerate(rows)]


@pytest.fixture(scope="module", params=list(BASES))
def roots(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Roots:
    return Roots(tmp_path_factory.mktemp(f"dyn-{request.param}"), request.param, 6, seed=11)


def test_loaded_on_demand_evicted_and_reloaded_match_peft_merged(roots: Roots) -> None:
    rng = random.Random(fresh_seed())
    llm = roots.llm(max_loras=2, max_cpu_loras=2)
    assert llm.lora is not None and llm.lora.names == []  # nothing loaded before a request names it
    # One at a time: a0, a1, a2 (a0 leaves both caches), a0 again (read again from its folder).
    for i, name in enumerate(["a0", "a1", "a2", "a0"]):
        rows: list[tuple[str | None, list[int]]] = [(name, p) for p in random_prompts(rng, 2, 3, 30)]
        roots.check(rows, llm.generate(_requests(rows)))
        assert len(llm.lora.cache.resident) <= 2 and len(llm.lora.cache.host) <= 2
        assert llm.lora.cache.num_loads == i + 1
    assert "a0" in llm.lora.names and "a1" not in llm.lora.names  # what the worker's heartbeat advertises
    # Every adapter and the base in one batch over the two slots: the others wait for a free slot.
    names: list[str | None] = [None, *roots.names]
    rows = [(names[i % len(names)], p) for i, p in enumerate(random_prompts(rng, 14, 3, 30))]
    roots.check(rows, llm.generate(_requests(rows)))
    assert set(llm.lora.completion_tokens) == set(roots.names)


def test_32_adapters_over_4_slots_in_one_batch(tmp_path: Path) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    many = Roots(tmp_path, "llama", 32, seed=seed % 1000)
    llm = many.llm(max_loras=4, max_cpu_loras=8, max_num_seqs=16)
    assert llm.lora is not None
    seen: list[int] = []
    begin = llm.lora.begin_step

    def watched(names: Any, q_lens: Any) -> None:  # the adapters each step ran, and the slots after it
        begin(names, q_lens)
        seen.append(len({n for n in names if n is not None}))
        assert len(llm.lora.cache.resident) <= 4 and len(llm.lora.cache.host) <= 8  # type: ignore[union-attr]

    llm.lora.begin_step = watched  # type: ignore[method-assign]
    names: list[str | None] = [*many.names, None, None]
    rows = [(n, p) for n, p in zip(names, random_prompts(rng, len(names), 3, 24), strict=True)]
    rng.shuffle(rows)
    many.check(rows, llm.generate(_requests(rows)))
    assert max(seen) == 4  # four adapters at once, never more
    assert llm.lora.cache.num_slot_loads >= 32 and llm.lora.cache.num_loads >= 32
    assert llm.num_free_blocks == llm.num_total_blocks


def test_base_and_running_adapters_go_past_a_line_waiting_for_a_slot(roots: Roots) -> None:
    llm = roots.llm(max_loras=1)
    rows: list[tuple[str | None, list[int]]] = [("a0", [5, 6, 7]), ("a1", [8, 9]), ("a0", [10, 11]), (None, [12])]
    for req in _requests(rows):
        llm.add_request(req)
    llm.step()
    assert sorted(s.lora or "" for s in llm.scheduler.running) == ["", "a0", "a0"]
    assert [s.lora for s in llm.scheduler.waiting] == ["a1"]  # it waits for a0's slot, it does not fail
    done: dict[str, Completion] = {}
    while llm.has_unfinished():
        done.update((c.request_id, c) for c in llm.step())
    roots.check(rows, [done[f"r{i}"] for i in range(len(rows))])


ESCAPES = ["..", "../outside/evil", "a/../../outside/evil", "/etc", "", ".", ".hidden", "~", "~root",
           "evil\\..\\..", "file:///tmp", "s3://bucket/evil", "http:", "%2e%2e%2foutside", "a..b", "x\x00y",
           "name with space", "C:evil", "-rf", "a" * 200]


def test_names_outside_the_roots_are_refused(roots: Roots, tmp_path: Path) -> None:
    # A valid adapter right beside the root: each escape below would reach it if names were paths.
    shutil.copytree(roots.root / "a0", tmp_path / "outside" / "evil")
    shutil.copytree(roots.root / "a0", tmp_path / "evil")
    (tmp_path / "root").mkdir()
    llm = LLM(str(roots.base), dtype="float32", kv_cache_memory=16 << 20, lora_roots=[str(tmp_path / "root")])
    for name in ESCAPES:
        with pytest.raises(LoraError, match="not a plain name"):
            check_adapter_name(name)
    done = llm.generate([Request(f"e{i}", prompt_token_ids=[5, 6], params=SamplingParams(max_tokens=2), lora=name)
                         for i, name in enumerate(ESCAPES)])
    for name, c in zip(ESCAPES, done, strict=True):
        assert c.error is not None and "not a plain name" in c.error, (name, c.error)
    assert llm.lora is not None and llm.lora.cache.num_loads == 0 and llm.lora.names == []


def test_corrupt_and_mismatched_adapters_fail_their_requests_only(roots: Roots, tmp_path: Path) -> None:
    root = tmp_path / "root"
    shutil.copytree(roots.root / "a1", root / "good")
    shutil.copytree(roots.root / "a2", root / "corrupt")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    other = make_tiny_model(tmp_path / "other", seed=5, hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    make_adapter(other, root / "wider", seed=9, r=4, targets=["q_proj", "down_proj"])
    _rename_target(roots.root / "a3", root / "unknown-target")
    shutil.copytree(roots.root / "a4", root / "config-only")
    (root / "config-only" / "adapter_model.safetensors").unlink()
    shutil.copytree(roots.root / "a5", root / "bad-json")
    (root / "bad-json" / "adapter_config.json").write_text("{not json")
    llm = LLM(str(roots.base), dtype="float32", kv_cache_memory=16 << 20, lora_roots=[str(root)])
    p = [5, 6, 7, 8]
    bad = {"corrupt": "cannot read", "wider": "another base model", "unknown-target": "not a linear layer",
           "config-only": "no adapter_model.safetensors", "bad-json": "cannot read", "missing": "not under the adapter roots"}
    reqs = [Request(n, prompt_token_ids=p, params=SamplingParams(max_tokens=4), lora=n) for n in bad]
    reqs += [Request("good", prompt_token_ids=p, params=SamplingParams(max_tokens=4), lora="good"),
             Request("base", prompt_token_ids=p, params=SamplingParams(max_tokens=4))]
    out = {c.request_id: c for c in llm.generate(reqs)}
    for name, why in bad.items():
        err = out[name].error or ""
        assert why in err and name in err and "\n" not in err, (name, err)
    assert out["base"].error is None and out["base"].token_ids == hf_greedy(roots.base_ref, p, 4)
    good = merged_model(roots.base, root / "good")
    assert out["good"].error is None
    assert_greedy_matches(good, p, out["good"].token_ids, hf_greedy(good, p, 4))
    # The same bad adapter again is refused from memory (a batch's lines do not read it each).
    loads = llm.lora.cache.num_loads  # type: ignore[union-attr]
    again = llm.generate([Request("x", prompt_token_ids=p, params=SamplingParams(max_tokens=2), lora="corrupt")])
    assert "cannot read" in (again[0].error or "") and llm.lora.cache.num_loads == loads  # type: ignore[union-attr]


def test_an_adapter_broken_after_it_was_checked_fails_its_requests_only(roots: Roots, tmp_path: Path) -> None:
    """Checked when its request came, out of memory since, its file broken meanwhile: read again when a step
    needs it, that fails its requests with the reason; the step's other requests run."""
    root = tmp_path / "root"
    for name in ("a0", "a1"):
        shutil.copytree(roots.root / name, root / name)
    llm = LLM(str(roots.base), dtype="float32", kv_cache_memory=16 << 20, lora_roots=[str(root)], max_loras=1,
              max_cpu_loras=1)
    rng = random.Random(fresh_seed())
    p = random_prompts(rng, 3, 3, 20)
    rows: list[tuple[str | None, list[int]]] = [("a0", p[0]), ("a1", p[1]), (None, p[2])]
    for req in _requests(rows):
        llm.add_request(req)  # each checked (a1 pushes a0 out of the CPU cache of one)
    (root / "a0" / "adapter_model.safetensors").write_bytes(b"broken since")
    done: dict[str, Completion] = {}
    while llm.has_unfinished():
        done.update((c.request_id, c) for c in llm.step())
    assert "cannot read" in (done["r0"].error or "") and "a0" in (done["r0"].error or "")
    roots.check(rows[1:], [done["r1"], done["r2"]])
    assert llm.num_free_blocks == llm.num_total_blocks


def _rename_target(src: Path, dst: Path) -> None:
    """A copy of adapter ``src`` whose weights name modules the base does not have (``q_proj`` -> ``x_q_proj``)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(dst / "adapter_model.safetensors")
    save_file({re.sub(r"\.(\w+_proj)\.lora_", r".x_\1.lora_", k): v for k, v in state.items()},
              dst / "adapter_model.safetensors")


def test_an_s3_root(roots: Roots, s3: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsspec prefix as the root: moto's S3 server, the store configured the fsspec way (what a worker reads
    from FSSPEC_S3_* variables)."""
    import fsspec.config

    pytest.importorskip("s3fs")
    fs = s3["fs"]
    for name in ("a0", "a3"):
        for f in (roots.root / name).iterdir():
            fs.put_file(str(f), f"sluice-test/adapters/{name}/{f.name}")
    monkeypatch.setitem(fsspec.config.conf, "s3", {**s3["opts"], "skip_instance_cache": True})
    llm = LLM(str(roots.base), dtype="float32", kv_cache_memory=16 << 20, lora_roots=["s3://sluice-test/adapters/"],
              max_loras=1, max_cpu_loras=1)
    rng = random.Random(fresh_seed())
    rows: list[tuple[str | None, list[int]]] = [(n, p) for n, p in zip(["a0", "a3", "a0", None, "a4"],
                                                                       random_prompts(rng, 5, 3, 20), strict=True)]
    done = llm.generate(_requests(rows))
    assert "not under the adapter roots" in (done[4].error or "")  # a4 is not in the bucket
    roots.check(rows[:4], done[:4])
    assert llm.lora is not None and llm.lora.cache.num_loads >= 3  # a0 read again after a3 took its place

