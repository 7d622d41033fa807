"""A cross-encoder: a sequence-classification model with one label (``*ForSequenceClassification``,
``num_labels`` 1) that scores a pair of texts read together, served by ``CrossEncoderEngine``.

It is the embedding engine with another model: the pair is tokenized as a pair by the model's own
tokenizer (segment ids included), batched by length the same way, and the classifier's logit, after the
model's activation, is the pair's "vector" of one value. The activation is sentence-transformers'
CrossEncoder's: the one its saved config names (``sentence_transformers.activation_fn``, or the older
``sbert_ce_default_activation_function``), else a sigmoid (its default for one label).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sluice.engine.embedding_engine import _DTYPES, EmbeddingEngine, _error_output, _RequestState
from sluice.engine.embedding_model import EmbeddingModel, _max_len
from sluice.engine.encoder_attention import pick_attention
from sluice.engine.encoder_linear import use_encoder_cpu_linear
from sluice.engine.models.base import UnsupportedModelError
from sluice.engine.pooling import PoolingConfig
from sluice.engine.pooling_runner import Item

_ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity"}  # torch.nn class name -> ours


def is_cross_encoder_model(model: str | None) -> bool:
    """Whether ``--model`` is a directory holding a sequence-classification model (config.json's
    ``architectures``), which serves /v1/score and /v1/rerank rather than embeddings or text."""
    if model is None:
        return False
    config = Path(model).expanduser() / "config.json"
    try:
        archs = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return False
    return any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in archs)


@dataclass
class CrossEncoderModel(EmbeddingModel):
    activation: str = "sigmoid"  # sigmoid | identity, applied to the logit

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, lengths: torch.Tensor,
              token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Right-padded pairs -> their scores [batch, 1], float32, after the activation."""
        logits = self.forward(input_ids, lengths, token_type_ids).logits.float().cpu()
        return torch.sigmoid(logits) if self.activation == "sigmoid" else logits


def load_cross_encoder(model: str, dtype: torch.dtype = torch.float32, device: str = "cpu",
                       cpu_linear: str = "auto", cpu_attention: str = "auto") -> CrossEncoderModel:
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    path = Path(model).expanduser().resolve()
    config = AutoConfig.from_pretrained(path)
    if int(config.num_labels) != 1:
        raise UnsupportedModelError(f"{path} classifies into {config.num_labels} labels: scoring needs a "
                                    "cross-encoder with one (num_labels 1)")
    activation = _activation(path, config)
    tokenizer = AutoTokenizer.from_pretrained(path)
    attention = pick_attention(cpu_attention, config, torch.device(device), dtype)
    net = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype, attn_implementation=attention)
    net = net.to(device).eval()
    linear = use_encoder_cpu_linear(net, cpu_linear, torch.device(device), dtype)
    # One value per pair, never normalised: the "pooling" of the embedding engine this model runs in.
    pcfg = PoolingConfig(mode="classifier", normalize=False, max_seq_length=None, dimension=1)
    return CrossEncoderModel(net, tokenizer, pcfg, _max_len(pcfg, config, tokenizer), int(config.vocab_size),
                             torch.device(device), path, linear, attention, activation)


def _activation(path: Path, config: Any) -> str:
    """sentence-transformers' CrossEncoder's activation for this model: what its files name, else sigmoid."""
    named = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") \
        or getattr(config, "sbert_ce_default_activation_function", None)
    st_config = path / "config_sentence_transformers.json"
    if named is None and st_config.is_file():
        named = json.loads(st_config.read_text()).get("activation_fn")
    if named is None:
        return "sigmoid"
    ours = _ACTIVATIONS.get(str(named).rsplit(".", 1)[-1])
    if ours is None:
        raise UnsupportedModelError(f"{path}: activation {named!r} is not supported (Sigmoid or Identity)")
    return ours


@dataclass
class PairRequest:
    request_id: str
    pairs: list[tuple[str, str]]  # each scored on its own
    truncate: bool | None = None  # None = the engine's setting


class CrossEncoderEngine(EmbeddingEngine):
    """``CrossEncoderEngine(model, **config)`` (EmbeddingConfig's settings): each request's pairs come back
    as an EmbeddingOutput whose ``embeddings`` hold one ``[score]`` per pair, in order."""

    serves = "score"

    def _load(self, model: str) -> EmbeddingModel:
        c = self.config
        return load_cross_encoder(model, _DTYPES[c.dtype], c.device, c.cpu_linear, c.cpu_attention)

    def add_request(self, request: PairRequest) -> None:  # type: ignore[override]
        arrival = time.time()
        try:
            self._check_new(request.request_id)
            truncate = self.config.truncate if request.truncate is None else request.truncate
            encoded, cut = self._tokenize_pairs(request.pairs, truncate)
        except ValueError as e:
            self._reject(_error_output(request.request_id, str(e), arrival))
            return
        items = [Item(next(self._seqs), request.request_id, i, ids, types) for i, (ids, types) in enumerate(encoded)]
        self.requests[request.request_id] = _RequestState(request, items, [None] * len(items), cut, arrival)  # type: ignore[arg-type]
        for it in items:
            self.pool.add(it)

    def _finish_vectors(self, batch: list[Item], pooled: torch.Tensor) -> list[list[float]]:
        return pooled.tolist()

    def _tokenize_pairs(self, pairs: list[tuple[str, str]],
                        truncate: bool) -> tuple[list[tuple[list[int], list[int] | None]], int]:
        """Each pair's token ids and segment ids (None where the tokenizer has none), within max_model_len,
        and how many pairs were cut (sentence-transformers' longest_first truncation)."""
        if not pairs:
            raise ValueError("no pairs to score")
        for i, (a, b) in enumerate(pairs):
            if not a or not b:
                raise ValueError(f"pair {i} has an empty text")
        limit = self.max_model_len
        enc = self._encode_pairs(pairs, None)
        long = [i for i, ids in enumerate(enc["input_ids"]) if len(ids) > limit]
        if long and not truncate:
            raise ValueError(f"pair {long[0]} has more tokens than this model takes ({limit}); shorten it or "
                             "allow truncation")
        if long:
            cut = self._encode_pairs([pairs[i] for i in long], limit)
            for key in enc:
                for i, v in zip(long, cut[key], strict=True):
                    enc[key][i] = v
        types = enc.get("token_type_ids") or [None] * len(pairs)
        return list(zip(enc["input_ids"], types, strict=True)), len(long)

    def _encode_pairs(self, pairs: list[tuple[str, str]], max_length: int | None) -> dict[str, list[Any]]:
        firsts, seconds = [a for a, _ in pairs], [b for _, b in pairs]
        if max_length is None:
            return dict(self.tokenizer(firsts, seconds, truncation=False, verbose=False))
        return dict(self.tokenizer(firsts, seconds, truncation="longest_first", max_length=max_length))
