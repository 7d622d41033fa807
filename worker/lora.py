"""Which LoRA adapter a job asks for: its ``model`` as ``"base:adapter"``, or a bare adapter name the
worker was started with (``--lora NAME=PATH``); anything else runs on the base model."""

from __future__ import annotations

from typing import Any

from sluice.jobs.keys import split_model


def adapter_names(engine: Any) -> list[str]:
    """The adapters ``engine`` serves (none for an engine without LoRA)."""
    lora = getattr(engine, "lora", None)
    return lora.names if lora is not None else []


def job_adapter(model: str | None, engine: Any) -> str | None:
    if not model:
        return None
    adapter = split_model(model)[1]
    if adapter is not None:
        return adapter  # an adapter this engine does not serve fails the job, with the reason
    return model if model in adapter_names(engine) else None
