"""The one in-process runner (worker/runner.py) of ``sluice generate`` and ``sluice.generate`` holds a
window of jobs, not its input: jobs are pulled only while the engine has room, each result is handed on
as it finishes, and every job gets exactly one Result (list prompts merged, a refused job failed alone)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import fresh_seed
from sluice.jobs.lines import parse_line
from sluice.jobs.schemas import Job, Result
from sluice.worker.runner import WINDOW_PER_SEQ, Runner

WORDS = ["river", "lamp", "cloud", "stone", "seven", "blue", "quiet", "north"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> Any:
    from sluice.engine.llm import LLM

    return LLM(str(tiny_model_dir), dtype="float32", max_num_seqs=4, kv_cache_memory=8 << 20)


def _jobs(rng: random.Random, n: int) -> list[Job]:
    jobs = []
    for i in range(n):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
        line = f'{{"custom_id": "j{i}", "prompt": "{text}", "max_tokens": {rng.randint(1, 6)}}}'
        if i % 17 == 5:  # a list prompt: one job, several engine requests, one Result
            line = f'{{"custom_id": "j{i}", "prompt": ["{text}", "a {text}"], "max_tokens": 2}}'
        if i % 23 == 7:  # a stop token id outside the vocabulary: refused, fails alone
            line = f'{{"custom_id": "j{i}", "prompt": "{text}", "stop_token_ids": [999999]}}'
        job = parse_line(line, i + 1)
        job.id = job.custom_id
        jobs.append(job)
    return jobs


def test_the_runner_holds_a_window_not_its_input(llm: Any) -> None:
    seed = fresh_seed()
    print(f"seed {seed}")
    jobs = _jobs(random.Random(seed), 120)
    results: dict[str, Result] = {}
    pulled = {"n": 0}
    most_open: list[int] = []

    def source() -> Iterator[Job]:
        for job in jobs:
            most_open.append(pulled["n"] - len(results))  # jobs pulled and not finished, at each pull
            pulled["n"] += 1
            yield job

    def done(job: Job, result: Result) -> None:
        assert job.custom_id not in results, f"{job.custom_id} got two results"
        results[job.custom_id] = result

    runner = Runner(llm, source(), done)
    runner.run()
    window = WINDOW_PER_SEQ * llm.config.max_num_seqs
    assert runner.window == window < len(jobs)
    assert max(most_open) <= window, f"{max(most_open)} jobs open at once, the window is {window} (seed {seed})"
    assert set(results) == {j.custom_id for j in jobs} and runner.in_flight == 0 and not llm.has_unfinished()
    for job in jobs:
        r = results[job.custom_id]
        refused = 999999 in job.params.stop_token_ids
        assert r.status == ("failed" if refused else "completed"), (job.custom_id, r.error, seed)
        if job.prompts is not None:
            assert len(r.choices) == len(job.prompts)
