"""Structured output on the real default model (SmolLM2-135M-Instruct): every completed constrained output
parses and validates, and the same requests without the constraint mostly do not (the grammar does the work)."""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import pytest
from helpers import fresh_seed
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams

SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}},
    "book": {"type": "object", "additionalProperties": False, "required": ["title", "author", "year"], "properties": {
        "title": {"type": "string", "maxLength": 30},
        "author": {"type": "object", "additionalProperties": False, "required": ["first", "last"],
                   "properties": {"first": {"type": "string", "maxLength": 12},
                                  "last": {"type": "string", "maxLength": 12}}},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2030}}},
    "palette": {"type": "object", "additionalProperties": False, "required": ["colors", "count"], "properties": {
        "colors": {"type": "array", "minItems": 1, "maxItems": 4,
                   "items": {"type": "string", "enum": ["red", "green", "blue", "black"]}},
        "count": {"type": "integer", "minimum": 1, "maximum": 4}}},
    "review": {"type": "object", "additionalProperties": False, "required": ["sentiment", "stars"], "properties": {
        "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]},
        "stars": {"type": "integer", "minimum": 1, "maximum": 5}, "spam": {"type": "boolean"}}},
    "place": {"type": "object", "additionalProperties": False, "required": ["city", "lat", "lon"], "properties": {
        "city": {"type": "string", "maxLength": 16}, "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180}}},
}
ASKS = {
    "person": ["Describe a famous scientist.", "Tell me about your best friend.", "Who wrote Hamlet?",
               "Name a singer you like.", "Invent a character for a story."],
    "book": ["Recommend a novel.", "What is a good book about history?", "Name a classic book.",
             "Which book should I read next?", "Tell me about a science fiction book."],
    "palette": ["Pick some colours for a flag.", "What colours are in a rainbow?", "Design a logo.",
                "Choose colours for a kitchen.", "What colour is the sea?"],
    "review": ["Review this: the food was cold and late.", "Review this: best phone I ever had!",
               "Review this: it is a chair.", "Review this: the film was far too long.",
               "Review this: lovely staff, will come back."],
    "place": ["Where is Paris?", "Tell me about Tokyo.", "Where is the Eiffel tower?", "Describe Sydney.",
              "Where is Cairo?"],
}
PHONE = r"\d{3}-\d{4}"
CHOICES = ["yes", "no", "maybe"]


def _params(rng: random.Random, sampled: bool, **guided: object) -> SamplingParams:
    if sampled:
        return SamplingParams(max_tokens=64, temperature=1.0, top_p=0.95, seed=rng.randrange(2**31), **guided)
    return SamplingParams(max_tokens=64, **guided)


@pytest.mark.slow
def test_smollm2_structured_outputs_validate() -> None:
    rng = random.Random(fresh_seed())
    llm = LLM(None, dtype="float32", kv_cache_memory=256 << 20)
    reqs, expect = [], {}
    for name, schema in SCHEMAS.items():
        for i, ask in enumerate(ASKS[name] * 2):  # each prompt greedy and sampled: 10 requests per schema
            msgs = [{"role": "user", "content": f"{ask} Answer in JSON."}]
            sampled = i >= len(ASKS[name])
            reqs.append(Request(f"{name}-{i}", messages=msgs, params=_params(rng, sampled, guided_json=schema)))
            expect[f"{name}-{i}"] = schema
            if i < 2:  # the same request without the constraint, for contrast
                reqs.append(Request(f"free-{name}-{i}", messages=msgs, params=_params(rng, sampled)))
    for i in range(4):
        msgs = [{"role": "user", "content": f"Question {i}: is water wet?"}]
        reqs.append(Request(f"choice-{i}", messages=msgs, params=_params(rng, i % 2 == 1, guided_choice=CHOICES)))
        msgs = [{"role": "user", "content": f"Give phone number number {i}."}]
        reqs.append(Request(f"regex-{i}", messages=msgs, params=_params(rng, i % 2 == 1, guided_regex=PHONE)))
    t0 = time.time()
    out = {c.request_id: c for c in llm.generate(reqs)}
    print(f"{len(reqs)} requests in {time.time() - t0:.1f}s, {llm.num_steps} steps")

    completed = [rid for rid in expect if out[rid].finish_reason == "stop"]
    for rid in expect:
        assert out[rid].finish_reason in ("stop", "length"), (rid, out[rid].finish_reason, out[rid].error)
    for rid in completed:
        jsonschema.validate(json.loads(out[rid].text), expect[rid])  # raises on any invalid output
    assert len(completed) >= 0.8 * len(expect), f"only {len(completed)}/{len(expect)} finished within max_tokens"
    assert llm.guided.num_compiled == len(SCHEMAS) + 2  # each distinct grammar compiled once

    for i in range(4):
        assert out[f"choice-{i}"].text in CHOICES
        assert re.fullmatch(PHONE, out[f"regex-{i}"].text), out[f"regex-{i}"].text
    free = [out[rid] for rid in out if rid.startswith("free-")]
    valid = sum(_validates(c.text, SCHEMAS[c.request_id.split("-")[1]]) for c in free)
    assert valid <= len(free) // 2, f"{valid}/{len(free)} unconstrained outputs validate: the test shows nothing"
    assert llm.max_running_seen == len(reqs)  # one continuous batch, constrained and free together


def _validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
