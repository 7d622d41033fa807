"""`sluice generate --lora NAME=PATH` and `sluice.generate(lora=...)` (issue 42, item 5): in-process, a line
(or a dataset row's model column) naming "BASE:ADAPTER" or the bare adapter runs on that adapter, greedy
text equal to peft's model over the same adapter; the base's lines stay the base's; an unknown adapter, or
one over --max-lora-rank, fails its own lines only."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from helpers import fresh_seed, hf_greedy, make_tiny_model, random_prompts
from lora_helpers import make_adapter, peft_model
from sluice.cli.main import EXIT_SOME_FAILED, cli

pytest.importorskip("peft")

MAX_NEW = 8
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


class Setup:
    """A tiny random Llama, one rank-8 adapter over it, and the references: the base and peft's model."""

    def __init__(self, root: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.base = make_tiny_model(root / "base", seed=3)
        self.adapter = make_adapter(self.base, root / "a", seed=1, r=8, targets=TARGETS)
        self.tokenizer = AutoTokenizer.from_pretrained(self.base)
        self.refs: dict[str | None, Any] = {
            None: AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32).eval(),
            "a": peft_model(self.base, self.adapter)}

    def text(self, adapter: str | None, prompt: list[int]) -> str:
        with torch.no_grad():
            ids = hf_greedy(self.refs[adapter], prompt, MAX_NEW)
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return Setup(tmp_path_factory.mktemp("generate-lora"))


def _read(path: Path) -> dict[str, dict]:
    return {x["custom_id"]: x for x in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def _generate(setup: Setup, tmp_path: Path, lines: list[dict[str, Any]], *flags: str) -> tuple[Any, dict, dict]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = ["generate", str(src), "-o", str(out), "--model", str(setup.base), "--dtype", "float32",
            "--kv-cache-memory", "16MiB", "--max-tokens", str(MAX_NEW), "--no-progress",
            "--lora", f"a={setup.adapter}", *flags]
    res = CliRunner().invoke(cli, args)
    return res, _read(out), _read(tmp_path / "out.errors.jsonl")


def test_generate_lines_on_their_adapter_match_peft(setup: Setup, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    p = random_prompts(rng, 3, min_len=4, max_len=30)
    # Same prompt on the base and on the adapter (either spelling): the adapter must change what it says.
    want = {"base": (None, p[0]), "base-named": (None, p[1]), "a-full": ("a", p[0]), "a-bare": ("a", p[1]),
            "a-other": ("a", p[2])}
    models = {"base": None, "base-named": "tiny", "a-full": "tiny:a", "a-bare": "a", "a-other": f"{setup.base}:a"}
    lines = [{"custom_id": cid, "prompt_token_ids": prompt, **({"model": models[cid]} if models[cid] else {})}
             for cid, (_, prompt) in want.items()]
    lines.append({"custom_id": "nope", "prompt_token_ids": p[2], "model": "tiny:nope"})
    res, got, errors = _generate(setup, tmp_path, lines)
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    assert set(got) == set(want) and set(errors) == {"nope"}, res.output
    assert "unknown LoRA adapter 'nope'" in errors["nope"]["error"]["message"]
    texts = {cid: got[cid]["response"]["body"]["choices"][0]["text"] for cid in want}
    for cid, (adapter, prompt) in want.items():
        assert texts[cid] == setup.text(adapter, prompt), cid
    assert texts["a-full"] != texts["base"] and texts["a-bare"] != texts["base-named"]


def test_max_lora_rank_reaches_the_engine(setup: Setup, tmp_path: Path) -> None:
    """--max-lora-rank below the adapter's rank 8: its lines fail with the reason, the base's run."""
    lines = [{"custom_id": "base", "prompt_token_ids": [100, 200, 300]},
             {"custom_id": "a", "prompt_token_ids": [100, 200, 300], "model": "tiny:a"}]
    res, got, errors = _generate(setup, tmp_path, lines, "--max-lora-rank", "4", "--max-loras", "1")
    assert res.exit_code == EXIT_SOME_FAILED, res.output
    assert set(got) == {"base"} and set(errors) == {"a"}, res.output
    assert "rank" in errors["a"]["error"]["message"], errors["a"]


def test_bad_lora_flags_are_one_line(setup: Setup, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "x"}\n')
    for bad in ("a", "x:y=/p", f"a={setup.adapter}"):  # no path, a colon in the name, a name given twice
        args = ["generate", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(setup.base),
                "--lora", f"a={setup.adapter}", "--lora", bad]
        res = CliRunner().invoke(cli, args)
        assert res.exit_code == 2 and "--lora" in res.output and "Traceback" not in res.output, res.output


def test_python_api_rows_name_their_adapter_in_a_model_column(setup: Setup) -> None:
    import sluice

    rng = random.Random(fresh_seed())
    words = ["river", "stone", "cloud", "lamp", "ember", "north", "quiet", "glass"]
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) for _ in range(2)]
    rows = [{"id": "base", "text": prompts[0], "model": None}, {"id": "a", "text": prompts[0], "model": "tiny:a"},
            {"id": "a-bare", "text": prompts[1], "model": "a"}, {"id": "nope", "text": prompts[1], "model": "tiny:nope"}]
    out = sluice.generate(rows, model=str(setup.base), prompt_column="text", id_column="id", model_column="model",
                          chat=False, lora={"a": str(setup.adapter)}, progress=False, max_tokens=MAX_NEW,
                          engine_options={"dtype": "float32", "kv_cache_memory": 16 << 20})
    by_id = {row["id"]: row for row in out}
    for cid, adapter, prompt in (("base", None, prompts[0]), ("a", "a", prompts[0]), ("a-bare", "a", prompts[1])):
        assert by_id[cid]["error"] is None, by_id[cid]
        want = setup.text(adapter, setup.tokenizer.encode(prompt))
        assert by_id[cid]["completion"] == want, cid
    assert by_id["a"]["completion"] != by_id["base"]["completion"]
    assert by_id["nope"]["completion"] is None and "unknown LoRA adapter 'nope'" in by_id["nope"]["error"]["message"]


def test_a_model_column_that_is_not_text_fails_its_row(tmp_path: Path) -> None:
    from sluice.jobs.datasets import RowError, RowSpec, read_requests

    src = tmp_path / "rows.jsonl"  # JSONL: read row by row, so a column may mix types
    src.write_text('{"prompt": "x", "m": "tiny:a"}\n{"prompt": "y", "m": 7}\n{"prompt": "z", "m": null}\n')
    got = list(read_requests(str(src), RowSpec(model_column="m")))
    assert json.loads(got[0].line)["model"] == "tiny:a" and "model" not in json.loads(got[2].line)
    assert isinstance(got[1], RowError) and got[1].code == "invalid_model" and "not a model name" in got[1].message


def test_python_api_lora_with_a_loaded_llm_is_refused(setup: Setup) -> None:
    import sluice

    with pytest.raises(ValueError, match="lora_modules="):
        sluice.generate([{"prompt": "x"}], llm=object(), lora={"a": str(setup.adapter)})
    with pytest.raises(ValueError, match="may not contain"):
        sluice.generate([{"prompt": "x"}], model=str(setup.base), lora={"a:b": str(setup.adapter)})


def test_lora_with_an_embedding_model_is_one_line(setup: Setup, tmp_path: Path) -> None:
    model = tmp_path / "st"  # what makes a folder an embedding model (a sentence-transformers modules.json)
    model.mkdir()
    (model / "modules.json").write_text("[]")
    src = tmp_path / "in.jsonl"
    src.write_text('{"custom_id": "e", "input": "x"}\n')
    res = CliRunner().invoke(cli, ["generate", str(src), "-o", str(tmp_path / "o.jsonl"), "--model", str(model),
                                   "--lora", f"a={setup.adapter}", "--no-progress"])
    assert res.exit_code == 1 and "need a generation model" in res.output and "Traceback" not in res.output, res.output
