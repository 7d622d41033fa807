"""The one mapping from a job's SamplingParams (jobs/schemas.py: validated, frozen, tuples) to the
engine's (engine/sampling_params.py: a dataclass, lists). Every field of either side is named here
(tests/worker/test_sampling_mapping.py walks both), so a field added to one side only fails that test rather
than a job at run time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from sluice.engine.sampling_params import SamplingParams as EngineParams
from sluice.jobs.schemas import SamplingParams as JobParams

# Job fields that are not sampling settings in the engine, and where each goes instead.
JOB_ONLY = {"chat_template_kwargs": "the engine Request's chat_template_kwargs (worker/convert.job_to_request)"}
# Engine fields no job sets (each keeps the engine's default).
ENGINE_ONLY: dict[str, str] = {}


def _list(v: Any) -> Any:
    return None if v is None else list(v)


# Fields whose value changes on the way (the rest are copied as they are).
CONVERT: dict[str, Callable[[Any], Any]] = {
    "max_tokens": lambda v: max(v, 1),  # 0 scores the prompt only: the engine samples one token, left out of the result
    "stop": _list,
    "stop_token_ids": _list,
    "guided_choice": _list,
}


def engine_field_names() -> list[str]:
    return [f.name for f in fields(EngineParams)]


def job_field_names() -> list[str]:
    return list(JobParams.model_fields)


def engine_params(p: JobParams) -> EngineParams:
    """The engine's settings for a job's; a ValueError for a combination the engine refuses."""
    values = {}
    for name in engine_field_names():
        if name in ENGINE_ONLY:
            continue
        value = getattr(p, name)
        values[name] = CONVERT[name](value) if name in CONVERT else value
    return EngineParams(**values)
