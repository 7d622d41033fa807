"""One mapping between a job's SamplingParams and the engine's (worker/sampling.py): every field of
either side is mapped or named as one side's own, and each mapped field's non-default value arrives."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from sluice.engine.sampling_params import SamplingParams as EngineParams
from sluice.jobs.schemas import SamplingParams as JobParams
from sluice.worker.sampling import CONVERT, ENGINE_ONLY, JOB_ONLY, engine_params

# A valid non-default value of each job field (alone: guided_* need no other field), and what the
# engine must then hold. A field added to the schema needs its line here.
SAMPLES: dict[str, tuple[Any, Any]] = {
    "max_tokens": (7, 7), "min_tokens": (2, 2), "temperature": (0.5, 0.5), "top_k": (3, 3), "top_p": (0.9, 0.9),
    "min_p": (0.1, 0.1), "seed": (42, 42), "repetition_penalty": (1.2, 1.2), "presence_penalty": (0.5, 0.5),
    "frequency_penalty": (-0.5, -0.5), "stop": (("x", "y"), ["x", "y"]), "stop_token_ids": ((5, 6), [5, 6]),
    "ignore_eos": (True, True), "n": (3, 3), "logprobs": (2, 2), "prompt_logprobs": (1, 1),
    "guided_json": ('{"type": "object"}', '{"type": "object"}'), "guided_json_object": (True, True),
    "guided_regex": ("a+", "a+"), "guided_choice": (("a", "b"), ["a", "b"]), "guided_grammar": ("root ::= \"a\"", "root ::= \"a\""),
    "max_reasoning_tokens": (9, 9),
}
NEEDS = {"guided_prefix": {"guided_regex": "a+"}, "guided_suffix": {"guided_regex": "a+"}}
SAMPLES |= {"guided_prefix": ("<t>", "<t>"), "guided_suffix": ("</t>", "</t>")}


def test_every_field_of_both_sides_is_mapped() -> None:
    job, engine = set(JobParams.model_fields), {f.name for f in fields(EngineParams)}
    unmapped_job = sorted(job - engine - set(JOB_ONLY))
    unmapped_engine = sorted(engine - job - set(ENGINE_ONLY))
    assert not unmapped_job, (f"jobs' SamplingParams has {unmapped_job} that the engine's lacks: add them to "
                              "engine/sampling_params.py, or to JOB_ONLY in worker/sampling.py saying where they go")
    assert not unmapped_engine, (f"the engine's SamplingParams has {unmapped_engine} that jobs' lacks: add them to "
                                 "jobs/schemas.py, or to ENGINE_ONLY in worker/sampling.py")
    stale = sorted((set(JOB_ONLY) & engine) | (set(ENGINE_ONLY) & job) | (set(CONVERT) - (job & engine)))
    assert not stale, f"worker/sampling.py names {stale} as one side's own or converted, which is not so"


def test_each_fields_value_reaches_the_engine() -> None:
    mapped = sorted(set(JobParams.model_fields) - set(JOB_ONLY))
    missing = [f for f in mapped if f not in SAMPLES]
    assert not missing, f"give {missing} a sample value in SAMPLES (tests/worker/test_sampling_mapping.py)"
    for name in mapped:
        given, expected = SAMPLES[name]
        params = engine_params(JobParams(**{name: given, **NEEDS.get(name, {})}))
        assert getattr(params, name) == expected, name
    defaults = engine_params(JobParams())
    for f in fields(EngineParams):  # the job's defaults are the engine's (max_tokens aside: both 256)
        assert getattr(defaults, f.name) == getattr(EngineParams(), f.name), f.name


def test_max_tokens_zero_samples_one_token() -> None:
    """max_tokens 0 scores the prompt only; the engine still samples one token (the result drops it)."""
    assert engine_params(JobParams(max_tokens=0, prompt_logprobs=1)).max_tokens == 1
