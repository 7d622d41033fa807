"""Fair share between the open batches of one priority (issue 43, item 7): a small batch submitted after a
huge one gets jobs on every read, so it finishes while the huge one has run only a few of its jobs,
instead of after all of them; a higher priority still goes first."""

from __future__ import annotations

import random
from pathlib import Path

import redis
from helpers import fresh_seed
from jobs_helpers import ThreadWorker, assert_exactly_once, prompt_lines, result_entries, wait_for
from reliability_helpers import final, tiny
from sluice.jobs.submit import submit

pytest_plugins = ["jobs_fixtures"]


def test_a_small_batch_behind_a_huge_one_finishes_within_a_bounded_share(r: redis.Redis,
                                                                         tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    huge = submit(prompt_lines(400, rng, max_tokens=2), r=r, model="tiny")
    small = submit(prompt_lines(10, rng, max_tokens=2), r=r, model="tiny")
    w = ThreadWorker(tiny(tiny_model_dir, max_num_seqs=4), lookahead=2)
    try:
        wait_for(lambda: final(r, small.id) and final(r, huge.id), 600, "both batches")
    finally:
        w.join()
    assert_exactly_once(r, small.id, 10)
    assert_exactly_once(r, huge.id, 400)
    # Equal shares: by the time the worker took the small batch's last job it had taken about as many of
    # the huge batch's (plus what one read and the engine's slots hold); first come first served, it would
    # have taken all 400 first. Counted from the worker's stamps when it takes a job, not by reading the
    # done count after the small batch ends, which grew with the machine's speed while the test polled.
    last_small = max(e["timings"]["started"] for e in result_entries(r, small.id))
    huge_taken = sum(e["timings"]["started"] <= last_small for e in result_entries(r, huge.id))
    assert huge_taken <= 10 + 4 + 4 * 2 + 8, huge_taken


def test_a_higher_priority_is_not_shared(r: redis.Redis, tiny_model_dir: Path) -> None:
    rng = random.Random(fresh_seed())
    low = submit(prompt_lines(40, rng, max_tokens=2), r=r, model="tiny")
    high = submit(prompt_lines(10, rng, max_tokens=2), r=r, model="tiny", priority=5)
    w = ThreadWorker(tiny(tiny_model_dir, max_num_seqs=4), lookahead=0)
    try:
        wait_for(lambda: final(r, high.id) and final(r, low.id), 300, "both batches")
    finally:
        w.join()
    assert_exactly_once(r, high.id, 10)
    assert_exactly_once(r, low.id, 40)
    # Every job of the higher priority was handed out before any of the lower one (not a race on the clock:
    # the worker stamps each job when it takes it).
    started = {b.id: [e["timings"]["started"] for e in result_entries(r, b.id)] for b in (high, low)}
    assert max(started[high.id]) <= min(started[low.id]), "a lower priority ran while a higher one waited"
