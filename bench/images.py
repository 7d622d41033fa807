"""Image captioning throughput (issue 45): 200 chat lines, each a photo and "Describe this image.", on a
SmolVLM-256M-shaped Idefics3 (random weights, the real shapes: SigLIP 768x12 at 512 px, pixel-shuffle 4,
64 image tokens a tile, a 576x30 Llama decoder), greedy, EOS ignored, each system in its own process.

    python bench/images.py                               # Sluice and transformers' batched generate, 200 lines
    python bench/images.py --vllm                        # and vLLM's CPU build (bench/.vllm-venv)
    python bench/images.py --vllm --dtype bfloat16 --runs 2   # bfloat16 (the fast dtype with AMX), best of two
    python bench/images.py --num-lines 4 --max-tokens 4 --tiny --tag images-smoke   # a quick smoke run
    python bench/images.py --vllm --dtype bfloat16 --runs 2 --skip-transformers   # Sluice and vLLM only

Photos: scikit-image's bundled sample images (skimage.data) where installed, resized and cropped into
variants; else generated ones (the line says which). The model and the photos are made once under
bench/out/. vLLM runs with bench/throughput.py's settings (every core, tcmalloc, its log in bench/out/TAG-vllm.log).
Prints tokens/s and images/s per system, best of ``--runs``; writes bench/out/TAG.json and TAG.md (the CPU named).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "out"
VLLM_VENV = HERE / ".vllm-venv"
sys.path.insert(0, str(HERE))
PROMPT = "Describe this image."
SKIMAGE = ["astronaut", "camera", "cat", "chelsea", "coffee", "hubble_deep_field", "immunohistochemistry", "motorcycle_left",
           "retina", "rocket", "coins", "page", "text", "moon", "horse", "grass", "gravel", "brick", "rocket", "colorwheel"]


def photos(root: Path, n: int, seed: int = 0) -> tuple[list[Path], str]:
    """``n`` PNG files: skimage's samples (else generated images), resized and cropped at random."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    try:
        from skimage import data

        bases = [Image.fromarray(np.asarray(getattr(data, k)())).convert("RGB") for k in dict.fromkeys(SKIMAGE)
                 if hasattr(data, k)]
        source = "scikit-image sample photos"
    except ImportError:
        bases = [Image.fromarray(np.random.RandomState(i).randint(0, 256, (48, 64, 3), dtype=np.uint8)).resize((640, 480))
                 for i in range(12)]
        source = "generated images (scikit-image not installed)"
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        img = bases[i % len(bases)]
        w, h = img.size
        cw, ch = rng.randint(w // 2, w), rng.randint(h // 2, h)
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        scale = rng.uniform(0.5, 1.5)
        variant = img.crop((x, y, x + cw, y + ch)).resize((max(int(cw * scale), 16), max(int(ch * scale), 16)))
        path = root / f"{i:04d}.png"
        variant.save(path)
        out.append(path)
    return out, source


def make_model(path: Path, tiny: bool) -> Path:
    """SmolVLM-256M's shapes with random weights (``tiny``: a few layers, for a smoke run)."""
    if (path / "config.json").exists():
        return path
    import torch
    from sluice.engine.loader import DEFAULT_MODEL, resolve_model
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessor,
        Idefics3Processor,
        LlamaConfig,
    )

    src = resolve_model(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
    tok.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>", "<global-img>",
                                                          "<end_of_utterance>"]})
    tok.add_tokens([f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
    layers = 2 if tiny else 30
    text = LlamaConfig(vocab_size=len(tok), hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2 if tiny else 12, num_attention_heads=12,
                  image_size=512, patch_size=16)
    cfg = Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=4,
                         image_token_id=tok.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(cfg).save_pretrained(path)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}"
                "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    images = Idefics3ImageProcessor(size={"longest_edge": 1024 if not tiny else 512},
                                    max_image_size={"longest_edge": 512}, do_image_splitting=True)
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=64, chat_template=template).save_pretrained(path)
    return path


def run_sluice(w: dict[str, Any]) -> dict[str, Any]:
    from sluice.engine.llm import LLM
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

    llm = LLM(w["model_dir"], dtype=w["dtype"], image_url_prefixes=(f"file://{w['photos_dir']}/",))
    params = SamplingParams(max_tokens=w["max_tokens"], temperature=0.0, ignore_eos=True)

    def request(i: int, path: str) -> Request:
        content = [{"type": "image", "url": path}, {"type": "text", "text": PROMPT}]
        return Request(f"r{i}", messages=[{"role": "user", "content": content}], params=params)

    llm.generate([request(-1, w["photos"][0])])  # warm, off the clock
    if llm.vision is not None:
        llm.vision.cache.clear()  # the timed run encodes every photo, as the other systems do
    t = time.perf_counter()
    outs = llm.generate([request(i, p) for i, p in enumerate(w["photos"])])
    secs = time.perf_counter() - t
    errors = [c.error for c in outs if c.error]
    assert not errors, errors[:3]
    return {"seconds": secs, "output_tokens": sum(len(c.token_ids) for c in outs),
            "prompt_tokens": sum(c.usage.prompt_tokens for c in outs)}


def run_transformers(w: dict[str, Any]) -> dict[str, Any]:
    import torch
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[w["dtype"]]
    proc = AutoProcessor.from_pretrained(w["model_dir"])
    proc.tokenizer.padding_side = "left"
    hf = AutoModelForImageTextToText.from_pretrained(w["model_dir"], dtype=dtype).eval()
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    t, tokens, prompt = time.perf_counter(), 0, 0
    batch = w["hf_batch_size"]
    for i in range(0, len(w["photos"]), batch):
        imgs = [[Image.open(p).convert("RGB")] for p in w["photos"][i : i + batch]]
        enc = proc(text=[text] * len(imgs), images=imgs, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = hf.generate(**enc, max_new_tokens=w["max_tokens"], min_new_tokens=w["max_tokens"], do_sample=False)
        tokens += (out.shape[1] - enc["input_ids"].shape[1]) * len(imgs)
        prompt += int(enc["attention_mask"].sum())
    return {"seconds": time.perf_counter() - t, "output_tokens": tokens, "prompt_tokens": prompt}


def run_vllm(w: dict[str, Any]) -> dict[str, Any]:  # in bench/.vllm-venv: imports nothing from the project
    from PIL import Image
    from vllm import LLM, SamplingParams

    llm = LLM(model=w["model_dir"], dtype=w["dtype"], seed=0, kv_cache_memory_bytes=4 << 30,
              limit_mm_per_prompt={"image": 1})
    params = SamplingParams(max_tokens=w["max_tokens"], temperature=0.0, ignore_eos=True)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    from transformers import AutoProcessor

    text = AutoProcessor.from_pretrained(w["model_dir"]).apply_chat_template(msgs, add_generation_prompt=True,
                                                                               tokenize=False)
    prompts = [{"prompt": text, "multi_modal_data": {"image": Image.open(p).convert("RGB")}} for p in w["photos"]]
    llm.generate(prompts[:1], params, use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t
    return {"seconds": secs, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "prompt_tokens": sum(len(o.prompt_token_ids or ()) for o in outs)}


CHILDREN = {"sluice": run_sluice, "transformers": run_transformers, "vllm": run_vllm}


def child(system: str, workload: Path, result: Path) -> None:
    w = json.loads(workload.read_text())
    r = CHILDREN[system](w)
    r.update(system=system, tokens_per_s=r["output_tokens"] / r["seconds"], images_per_s=len(w["photos"]) / r["seconds"])
    result.write_text(json.dumps(r))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-lines", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of the same widths (smoke runs)")
    p.add_argument("--vllm", action="store_true")
    p.add_argument("--skip-transformers", action="store_true", help="only Sluice (and vLLM with --vllm): a rerun")
    p.add_argument("--runs", type=int, default=1, help="runs per system; the best is reported")
    p.add_argument("--tag", default="images")
    p.add_argument("--child", nargs=3, metavar=("SYSTEM", "WORKLOAD", "RESULT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child[0], Path(a.child[1]), Path(a.child[2]))
        return
    model = make_model(OUT / ("images-smolvlm-tiny" if a.tiny else "images-smolvlm-256m"), a.tiny)
    paths, source = photos(OUT / "images-photos", a.num_lines)
    w = {"model_dir": str(model), "photos": [str(x) for x in paths], "photos_dir": str(paths[0].parent),
         "max_tokens": a.max_tokens, "dtype": a.dtype, "hf_batch_size": a.hf_batch_size}
    workload = OUT / f"{a.tag}-workload.json"
    workload.write_text(json.dumps(w))
    from throughput import machine

    systems = ["sluice"] + ([] if a.skip_transformers else ["transformers"]) + (["vllm"] if a.vllm else [])
    results = []
    for system in systems:
        best: dict[str, Any] | None = None
        for _ in range(a.runs):
            r = run_system(system, workload, a.tag)
            if best is None or r["seconds"] < best["seconds"]:
                best = r
        assert best is not None
        results.append(best)
        print(f"{system}: {best['tokens_per_s']:.1f} tok/s, {best['images_per_s']:.2f} images/s "
              f"({best['output_tokens']} tokens, {best['prompt_tokens']} prompt tokens, {best['seconds']:.1f}s)", flush=True)
    report = {"machine": machine(), "photos": source, "lines": a.num_lines, "dtype": a.dtype, "runs": a.runs,
              "max_tokens": a.max_tokens, "command": "python bench/images.py " + " ".join(sys.argv[1:]), "results": results}
    (OUT / f"{a.tag}.json").write_text(json.dumps(report, indent=1))
    (OUT / f"{a.tag}.md").write_text(markdown(report))
    print(f"photos: {source}; wrote {OUT / a.tag}.json and .md")


def run_system(system: str, workload: Path, tag: str) -> dict[str, Any]:
    out = OUT / f"{tag}-{system}.json"
    cmd = [sys.executable, __file__, "--child", system, str(workload), str(out)]
    if system != "vllm":
        subprocess.run(cmd, check=True, env=dict(os.environ))
    else:  # its own venv, both cores and tcmalloc, as in bench/throughput.py; its log kept to check how it ran
        from throughput import vllm_env

        cmd[0] = str(VLLM_VENV / "bin" / "python")
        with (OUT / f"{tag}-vllm.log").open("ab") as f:
            subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env=vllm_env(VLLM_VENV))
    return json.loads(out.read_text())


def markdown(report: dict[str, Any]) -> str:
    from throughput_report import describe_cpu

    m = report["machine"]
    base = {r["system"]: r["tokens_per_s"] for r in report["results"]}
    lines = [f"{describe_cpu(m)}; {report['dtype']}; {report['lines']} captioning lines x {report['max_tokens']} tokens "
             f"({report['photos']}); best of {report['runs']}.", "", f"Command: `{report['command']}`", "",
             "| system | tokens/s | images/s | prompt tokens | s | Sluice vs it |", "| --- | --- | --- | --- | --- | --- |"]
    for r in report["results"]:
        ratio = base.get("sluice", 0.0) / r["tokens_per_s"]
        lines.append(f"| {r['system']} | {r['tokens_per_s']:.1f} | {r['images_per_s']:.2f} | {r['prompt_tokens']:,} | "
                     f"{r['seconds']:.1f} | {ratio:.2f}x |")
    return "\n".join(lines) + "\n"

if __name__ == "__main__":
    main()
