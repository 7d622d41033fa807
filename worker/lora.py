"""Which LoRA adapter a job asks for: its ``model`` as ``"base:adapter"`` (an adapter registered, or one to
load from the adapter roots), or a bare adapter name the worker was started with (``--lora NAME=PATH``);
anything else runs on the base model."""

from __future__ import annotations

from typing import Any

from sluice.jobs.keys import split_model


def adapter_names(engine: Any) -> list[str]:
    """The adapters ``engine`` serves without a lookup: registered or loaded now (none without LoRA). A worker
    with adapter roots serves others too (``loads_adapters``), loading each when a line names it."""
    lora = engine.lora
    return lora.names if lora is not None else []


def loads_adapters(engine: Any) -> bool:
    """Whether ``engine`` loads adapters named by lines from its adapter roots (``--lora-root``)."""
    lora = engine.lora
    return bool(lora is not None and lora.dynamic)


def job_adapter(model: str | None, engine: Any) -> str | None:
    if not model:
        return None
    adapter = split_model(model)[1]
    if adapter is not None:
        return adapter  # an adapter this engine does not serve fails the job, with the reason
    lora = engine.lora
    return model if lora is not None and model in lora.registered else None
