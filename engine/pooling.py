"""How an embedding model turns token states into one vector: a sentence-transformers model directory's
pooling, normalisation and length limit, read from its files, and the pooling itself.

A sentence-transformers directory is a transformers model plus ``modules.json`` (the module chain:
Transformer -> Pooling -> optional Normalize), ``<pooling dir>/config.json`` (the pooling mode, in the
legacy ``pooling_mode_*_tokens`` booleans or the newer ``pooling_mode`` string) and
``sentence_bert_config.json`` (``max_seq_length``). A plain transformers directory without them is
taken as an encoder with mean pooling only when asked (``default_pooling``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sluice.engine.models.base import UnsupportedModelError

POOLING_MODES = ("mean", "cls", "max", "lasttoken")
_LEGACY_KEYS = {  # sentence-transformers' pre-v6 booleans, in its own order of precedence
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_ST_PREFIX = "sentence_transformers.models."


@dataclass(frozen=True)
class PoolingConfig:
    mode: str  # mean | cls | max | lasttoken
    normalize: bool  # a Normalize module follows the pooling (unit-length vectors)
    max_seq_length: int | None  # tokens the model was trained to take; None = the model config's limit
    dimension: int  # the pooled vector's length
    # ``dimensions`` (Matryoshka truncation) is allowed: the model says it was trained for it
    # (config.json ``is_matryoshka`` / ``matryoshka_dimensions``, as vLLM reads them) or the engine is
    # told so. None = any length from 1 to ``dimension``.
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    # config_sentence_transformers.json's prompt named by default_prompt_name: sentence-transformers puts
    # it before every text it encodes unless told otherwise, and so do we (token id inputs stay as given).
    default_prompt: str = ""


def is_sentence_transformers_dir(path: str | Path) -> bool:
    return (Path(path) / "modules.json").is_file()


def read_pooling_config(path: str | Path, hf_config: Any) -> PoolingConfig:
    """The pooling of the sentence-transformers model at ``path`` (its transformers config already read)."""
    root = Path(path)
    modules = _read_json(root / "modules.json")
    if not isinstance(modules, list):
        raise UnsupportedModelError(f"{root}/modules.json is not a list of modules")
    kinds = [str(m.get("type", "")).removeprefix(_ST_PREFIX) for m in modules]
    if not kinds or not kinds[0].endswith("Transformer"):
        raise UnsupportedModelError(f"{root}: the first module must be a Transformer, not {kinds[:1]}")
    pool_entries = [m for m, k in zip(modules, kinds, strict=True) if k.endswith("Pooling")]
    if len(pool_entries) != 1:
        raise UnsupportedModelError(f"{root}: needs exactly one Pooling module, found {len(pool_entries)}")
    unknown = [k for k in kinds[1:] if not (k.endswith("Pooling") or k.endswith("Normalize"))]
    if unknown:
        # A Dense projection or other head would change the vectors: refuse rather than differ silently.
        raise UnsupportedModelError(f"{root}: unsupported sentence-transformers modules {unknown}")
    pool = _read_json(root / str(pool_entries[0].get("path", "")) / "config.json")
    mode = _pooling_mode(pool)
    hidden = int(getattr(hf_config, "hidden_size", 0))
    dim = int(pool.get("embedding_dimension", pool.get("word_embedding_dimension", hidden)))
    if hidden and dim != hidden:
        raise UnsupportedModelError(f"{root}: pooling dimension {dim} differs from the model's hidden size {hidden}")
    if pool.get("include_prompt", True) is False:
        raise UnsupportedModelError(f"{root}: pooling that excludes the prompt (include_prompt false) is not supported")
    st = _read_json(root / "sentence_bert_config.json") if (root / "sentence_bert_config.json").is_file() else {}
    max_len = st.get("max_seq_length")
    return PoolingConfig(mode=mode, normalize=any(k.endswith("Normalize") for k in kinds),
                         max_seq_length=int(max_len) if max_len else None, dimension=dim,
                         default_prompt=_default_prompt(root), **_matryoshka(hf_config))


def default_pooling(hf_config: Any, mode: str = "mean", normalize: bool = True) -> PoolingConfig:
    """For a plain transformers directory (no modules.json): the caller names the pooling."""
    if mode not in POOLING_MODES:
        raise ValueError(f"pooling must be one of {POOLING_MODES}, not {mode!r}")
    return PoolingConfig(mode=mode, normalize=normalize, max_seq_length=None,
                         dimension=int(hf_config.hidden_size), **_matryoshka(hf_config))


def _pooling_mode(pool: dict[str, Any]) -> str:
    mode: Any = pool.get("pooling_mode")
    if mode is None:
        modes = [m for k, m in _LEGACY_KEYS.items() if pool.get(k)]
        mode = modes if len(modes) != 1 else modes[0]
        if not modes:
            mode = "mean"  # sentence-transformers' own default when no flag is set
    if isinstance(mode, list | tuple):
        mode = mode[0] if len(mode) == 1 else tuple(mode)
    if mode not in POOLING_MODES:
        raise UnsupportedModelError(f"pooling mode {mode!r} is not supported (supported: {', '.join(POOLING_MODES)})")
    return str(mode)


def _default_prompt(root: Path) -> str:
    f = root / "config_sentence_transformers.json"
    cfg = _read_json(f) if f.is_file() else {}
    name = cfg.get("default_prompt_name")
    if not name:
        return ""
    prompts = cfg.get("prompts") or {}
    if name not in prompts:
        raise UnsupportedModelError(f"{f}: default_prompt_name {name!r} is not one of its prompts")
    return str(prompts[name])


def _matryoshka(hf_config: Any) -> dict[str, Any]:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    flag = bool(getattr(hf_config, "is_matryoshka", False)) or bool(dims)
    return {"matryoshka": flag, "matryoshka_dimensions": tuple(int(d) for d in dims) if dims else None}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise UnsupportedModelError(f"{path} not found: not a sentence-transformers model directory") from e
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{path} is not valid JSON: {e}") from e


# ---- the pooling itself ---------------------------------------------------------------------------
def pool(hidden: torch.Tensor, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """``hidden`` [batch, seq, dim] of right-padded sequences of ``lengths`` -> [batch, dim] in float32."""
    if mode == "cls":
        return hidden[:, 0].float()
    if mode == "lasttoken":
        # Right padding: a causal model's last real token never saw the padding after it.
        return hidden[torch.arange(hidden.shape[0]), lengths - 1].float()
    mask = torch.arange(hidden.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)  # [batch, seq]
    if mode == "max":
        return hidden.float().masked_fill(~mask.unsqueeze(-1), float("-inf")).amax(dim=1)
    summed = (hidden.float() * mask.unsqueeze(-1)).sum(dim=1)
    return summed / lengths.unsqueeze(1).float()


def finish_vector(vec: torch.Tensor, normalize: bool, dimensions: int | None) -> torch.Tensor:
    """Matryoshka truncation to ``dimensions``, then the model's normalisation: a normalising model's short
    vector is a unit vector again (as OpenAI's ``dimensions`` gives), another model's is only cut."""
    if dimensions is not None and dimensions < vec.shape[-1]:
        vec = vec[..., :dimensions]
    if normalize:
        vec = torch.nn.functional.normalize(vec, p=2, dim=-1)
    return vec
