"""The one place an engine is built from a model and its options: a cross-encoder, an embedding engine or
the generation engine, by what the model is (the worker, ``sluice generate`` and ``sluice.generate`` call
``build_engine``)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from sluice.engine.protocol import Engine


def build_engine(model: str | None, options: dict[str, Any] | None = None) -> Engine:
    """The engine serving ``model``; ``options`` are EngineConfig's settings (an embedding engine takes
    those it has: ``embedding_options``)."""
    from sluice.engine.cross_encoder import is_cross_encoder_model
    from sluice.engine.embedding_model import is_embedding_model

    options = options or {}
    if is_cross_encoder_model(model):  # before is_embedding_model: a CrossEncoder may have modules.json
        from sluice.engine.cross_encoder import CrossEncoderEngine

        assert model is not None
        return CrossEncoderEngine(model, **embedding_options(options))  # type: ignore[return-value]
    if model is not None and is_embedding_model(model):
        from sluice.engine.embedding_engine import EmbeddingEngine

        if options.get("lora_modules"):
            raise ValueError("LoRA adapters (--lora) need a generation model, not an embedding model")
        return EmbeddingEngine(model, **embedding_options(options))  # type: ignore[return-value]
    from sluice.engine.llm import LLM

    return LLM(model, **options)


def check_row_model(model: str | None) -> None:
    """A dataset's rows are generated or embedded: a cross-encoder (it scores pairs) is a ValueError, before
    it loads."""
    from sluice.engine.cross_encoder import is_cross_encoder_model

    if is_cross_encoder_model(model):
        raise ValueError("a cross-encoder scores pairs: give it /v1/score or /v1/rerank lines (JSONL), not a dataset")


def embedding_options(options: dict[str, Any]) -> dict[str, Any]:
    """The engine options an embedding engine has (the CLI's KV cache, policy, ... are generation's);
    dtype "auto" is float32 there."""
    from sluice.engine.embedding_engine import EmbeddingConfig

    names = {f.name for f in fields(EmbeddingConfig)}
    out = {k: v for k, v in options.items() if k in names}
    if out.get("dtype") == "auto":
        out.pop("dtype")
    return out
