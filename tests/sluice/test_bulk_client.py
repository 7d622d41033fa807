"""A real bulk client through Sluice's OpenAI endpoints: bench/bulk_client.py runs lm-evaluation-harness's
``local-completions`` (from its own venv) against ``sluice serve`` and a worker on the tiny model. Every
log-likelihood lm-eval got (``echo`` + ``logprobs`` on the prompt's tokens) is transformers' own on the
same weights, and so is whether the continuation is greedy; every generation is transformers' greedy
text cut where lm-eval's stop strings cut it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cli_api_helpers import ROOT, free_port

VENV = Path(os.environ.get("SLUICE_LMEVAL_VENV", "/work/venvs/lmeval"))
pytestmark = pytest.mark.skipif(not (VENV / "bin" / "lm_eval").exists(),
                                reason=f"needs lm-evaluation-harness in its own venv at {VENV} "
                                       "(`python bench/bulk_client.py` makes it; or set SLUICE_LMEVAL_VENV)")


def _samples(out: Path, task: str) -> list[dict[str, Any]]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    assert files, f"lm-eval wrote no samples for {task} under {out}"
    return [json.loads(x) for x in files[-1].read_text().splitlines()]


def test_lm_eval_local_completions_through_sluice(tiny_model_dir: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    cmd = [sys.executable, "bench/bulk_client.py", "--model", str(tiny_model_dir), "--venv", str(VENV),
           "--worker-args", "--dtype float32", "--out", str(out), "--port", str(free_port()), "--num-concurrent", "8"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    mc = _samples(out, "sluice_mc")
    assert len(mc) == 16
    scored = 0
    for s in mc:
        for args, resp in zip(s["arguments"].values(), s["resps"], strict=True):
            context, continuation = args["arg_0"], args["arg_1"]
            # lm-eval's split: the whole text tokenized, the context's tokens first.
            ctx = tok(context, add_special_tokens=False).input_ids
            whole = tok(context + continuation, add_special_tokens=False).input_ids
            with torch.no_grad():
                logp = torch.log_softmax(hf(torch.tensor([whole])).logits[0].float(), -1)
            targets = torch.tensor(whole[len(ctx):])
            rows = logp[len(ctx) - 1:len(whole) - 1]
            want = rows.gather(1, targets[:, None]).sum().item()
            greedy = bool((rows.argmax(-1) == targets).all())
            got, got_greedy = float(resp[0][0]), resp[0][1] == "True"
            assert abs(got - want) < 2e-3, (context, continuation, got, want)
            assert got_greedy == greedy, (context, continuation)
            scored += 1
    assert scored == 64

    gen = _samples(out, "sluice_gen")
    assert len(gen) == 8
    eos = tok.decode([tok.eos_token_id])
    for s in gen:
        context, kw = s["arguments"]["gen_args_0"]["arg_0"], s["arguments"]["gen_args_0"]["arg_1"]
        ids = tok(context, add_special_tokens=False).input_ids
        with torch.no_grad():
            new = hf.generate(torch.tensor([ids]), max_new_tokens=kw["max_gen_toks"], do_sample=False)[0, len(ids):]
        text = tok.decode(new)
        for stop in [*kw["until"], eos]:
            text = text.split(stop)[0]
        assert s["resps"][0][0] == text, (context, s["resps"][0][0], text)
