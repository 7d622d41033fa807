"""Planning a batch by shared prefixes (issue 44): jobs sharing a prompt prefix are handed out together,
deadlines first, priorities untouched; with a KV cache too small for every prefix, the planned order
computes each prefix about once where arrival order recomputes it, and greedy outputs are the same."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import redis
from helpers import fresh_seed
from jobs_helpers import assert_exactly_once, few_shot_lines, result_entries
from reliability_helpers import run_to_end, tiny
from sluice.jobs import keys
from sluice.jobs.lines import parse_line
from sluice.jobs.prefix_plan import plan, planned, prompt_key
from sluice.jobs.submit import submit

pytest_plugins = ["jobs_fixtures"]

def test_plan_groups_shared_prefixes_and_puts_deadlines_first() -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    lines, groups = few_shot_lines(rng, 5, 7, 2)
    jobs = [parse_line(t, i + 1) for i, t in enumerate(lines)]
    group_of = {j.custom_id: g for j, g in zip(jobs, groups, strict=True)}
    order = [group_of[j.custom_id] for j in plan(jobs)]
    runs = [g for i, g in enumerate(order) if i == 0 or order[i - 1] != g]
    assert sorted(runs) == sorted(set(groups)), (seed, order)  # each group is one run
    assert sorted(j.custom_id for j in plan(jobs)) == sorted(j.custom_id for j in jobs)
    # Deadlines first, earliest first, whatever their prompts; the rest keep their groups.
    late = rng.sample(range(len(jobs)), 3)
    for n, i in enumerate(late):
        jobs[i].deadline = 2e9 - n
    got = plan(jobs)
    assert [j.deadline for j in got[:3]] == sorted(jobs[i].deadline for i in late), seed
    assert all(j.deadline is None for j in got[3:]), seed
    # A stream read in windows is planned window by window, nothing lost or repeated.
    ids = [j.custom_id for j in planned(iter(jobs), window=6)]
    assert sorted(ids) == sorted(j.custom_id for j in jobs), seed


def test_prompt_keys_share_a_prefix_exactly_when_prompts_do() -> None:
    def key(**body: Any) -> str:
        return prompt_key(parse_line(json.dumps(body), 1))

    system = {"role": "system", "content": "S"}
    a = key(messages=[system, {"role": "user", "content": "x"}])
    b = key(messages=[system, {"role": "user", "content": "y"}])
    c = key(messages=[system, {"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    assert os.path.commonprefix([a, b]) == a[:-1] == b[:-1]  # all but the last question's text
    assert "S" not in os.path.commonprefix([a, c])  # tools lead the prompt: nothing of the system turn shared


def test_submit_hands_out_each_chunk_by_prefix_and_keeps_priorities(r: redis.Redis) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    lines, groups = few_shot_lines(rng, 4, 6, 1)
    urgent = rng.sample(range(len(lines)), 2)
    for i in urgent:
        lines[i] = json.dumps({**json.loads(lines[i]), "priority": 5})
    b = submit(lines, r=r, model="q", chunk=len(lines))
    group_of = {f"q{n}": g for n, g in enumerate(groups)}
    normal = [json.loads(f["j"])["custom_id"] for _, f in r.xrange(keys.jobs(b.id, 0))]
    high = [json.loads(f["j"])["custom_id"] for _, f in r.xrange(keys.jobs(b.id, 5))]
    assert sorted(high) == sorted(f"q{i}" for i in urgent), seed  # its own stream, pulled first
    order = [group_of[c] for c in normal]
    runs = [g for i, g in enumerate(order) if i == 0 or order[i - 1] != g]
    assert len(runs) == len(set(order)), (seed, order)
    arrival = submit(lines, r=r, model="q", chunk=len(lines), plan=False)
    assert [json.loads(f["j"])["custom_id"] for _, f in r.xrange(keys.jobs(arrival.id, 0))] == \
        [f"q{n}" for n in range(len(lines)) if n not in urgent], seed


def _prompt_tokens_computed(entries: list[dict[str, Any]]) -> int:
    return sum(e["usage"]["prompt_tokens"] - e["usage"]["cached_tokens"] for e in entries)


def test_a_planned_batch_computes_each_prefix_about_once_with_the_same_outputs(r: redis.Redis,
                                                                               tiny_model_dir: Path) -> None:
    """Eight shuffled few-shot groups through a worker whose KV cache holds about two prefixes at a time:
    arrival order recomputes prefixes; the planned order computes at most 1.1x the minimum (each group's
    shared blocks once, every prompt's remainder once), and every completion is the same (greedy)."""
    seed = fresh_seed()
    rng = random.Random(seed)
    lines, _ = few_shot_lines(rng, 8, 6, 4)
    probe = tiny(tiny_model_dir, block_size=16)
    per_block = (4 << 20) // probe.num_total_blocks  # bytes of one block's KV
    toks = [_prompt_ids(probe, t) for t in lines]
    shared = _shared_blocks(toks, lines, 16)
    longest = max(len(t) for t in toks) // 16 + 2
    budget = 2 * max(shared.values()) + 4 * longest  # two prefixes, and room for four running prompts
    got = {}
    for name, do_plan in (("arrival", False), ("planned", True)):
        llm = tiny(tiny_model_dir, max_num_seqs=4, block_size=16, kv_cache_memory=budget * per_block)
        b = submit(lines, r=r, model="tiny", plan=do_plan)
        run_to_end(r, b.id, llm, timeout=300)
        assert_exactly_once(r, b.id, len(lines))
        got[name] = result_entries(r, b.id)
        assert {e["status"] for e in got[name]} == {"completed"}, (seed, got[name][0])
    texts = {n: {e["custom_id"]: e["text"] for e in es} for n, es in got.items()}
    assert texts["arrival"] == texts["planned"], seed
    computed = {n: sum(e["usage"]["prompt_tokens"] - e["usage"]["cached_tokens"] for e in es)
                for n, es in got.items()}
    members = {g: sum(1 for line in lines if _group(line) == g) for g in shared}
    minimum = sum(len(t) for t in toks) - sum((members[g] - 1) * 16 * blocks for g, blocks in shared.items())
    print(f"seed={seed} prompt tokens computed: arrival {computed['arrival']}, planned {computed['planned']}, "
          f"minimum {minimum} ({budget} KV blocks)")
    assert computed["planned"] <= 1.1 * minimum, (seed, computed, minimum)
    assert computed["arrival"] > computed["planned"], (seed, computed)


def _group(line: str) -> str:
    return json.loads(line)["messages"][0]["content"]


def _prompt_ids(llm: Any, line: str) -> list[int]:
    ids = llm.tokenizer.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _shared_blocks(toks: list[list[int]], lines: list[str], bs: int) -> dict[str, int]:
    """Per group, the whole blocks its prompts share (the prefix cache keeps whole blocks)."""
    out: dict[str, int] = {}
    for g in {_group(line) for line in lines}:
        mine = [t for t, line in zip(toks, lines, strict=True) if _group(line) == g]
        common = 0
        while all(len(t) > common for t in mine) and len({t[common] for t in mine}) == 1:
            common += 1
        out[g] = common // bs
    return out


def test_prompt_tokens_served_from_cache_per_batch_and_per_worker(r: redis.Redis, tiny_model_dir: Path) -> None:
    """The batch's usage and the worker's heartbeat say how many prompt tokens the prefix cache served; the
    dashboard's workers page shows the worker's share."""
    from jobs_helpers import ThreadWorker, wait_for
    from reliability_helpers import final
    from sluice.api.dashboard import worker_row
    from sluice.jobs.store import get_batch, list_workers

    seed = fresh_seed()
    lines, _ = few_shot_lines(random.Random(seed), 2, 4, 3)
    b = submit(lines, r=r, model="tiny")
    w = ThreadWorker(tiny(tiny_model_dir, block_size=16), worker_id="cache")
    try:
        wait_for(lambda: final(r, b.id), 300, "the batch")
        wait_for(lambda: any(x.cached_tokens for x in list_workers(r)), 30, "a heartbeat with the counts")
        beat = next(x for x in list_workers(r) if x.id == "cache")
    finally:
        w.join()
    usage = get_batch(r, b.id).usage
    assert 0 < usage.cached_tokens < usage.prompt_tokens, (seed, usage)
    assert (beat.cached_tokens, beat.prompt_tokens) == (usage.cached_tokens, usage.prompt_tokens), seed
    row = worker_row(beat, beat.time)
    assert row["cache_percent"] == 100.0 * usage.cached_tokens / usage.prompt_tokens
