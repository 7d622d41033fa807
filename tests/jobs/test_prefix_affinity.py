"""Prefix-group affinity (issue 44, item 3): with several workers, the jobs of one prefix group go to the
worker that took the group's first jobs, so each group's shared prefix is computed by one worker; a group
is split only when its owner goes quiet (busy or dead), and every job still gets exactly one outcome."""

from __future__ import annotations

import random
import time
from collections import defaultdict
from pathlib import Path

import redis
from helpers import fresh_seed
from jobs_helpers import (
    assert_exactly_once,
    few_shot_lines,
    held_by,
    result_entries,
    wait_for,
    worker_process,
)
from reliability_helpers import run_to_end, tiny
from sluice.jobs import keys
from sluice.jobs import scripts as script
from sluice.jobs.consumer import commands
from sluice.jobs.prefix_plan import groups
from sluice.jobs.scripts import Scripts
from sluice.jobs.submit import submit

pytest_plugins = ["jobs_fixtures"]


def _queue(model: str) -> str:
    return keys.queue_name(model)


def _read(r: redis.Redis, consumer: str, n: int, model: str = "q") -> list[commands.Delivery]:
    queue = _queue(model)
    return commands.read(r, queue, consumer, n, commands.ready(r, queue)).deliveries


def _owners(got: dict[str, list[commands.Delivery]], group_of: dict[str, str]) -> dict[str, set[str]]:
    owners: dict[str, set[str]] = defaultdict(set)
    for consumer, ds in got.items():
        for d in ds:
            owners[group_of[d.job.custom_id or ""]].add(consumer)
    return owners


def test_groups_are_runs_of_a_long_shared_prefix_cut_where_it_falls() -> None:
    system = "s" * 300
    docs = [f"doc{i} " * 400 for i in range(3)]
    prompts = sorted(system + d + f"question {j}" for d in docs for j in range(4))
    got = groups(prompts)
    assert [len(set(got[i:i + 4])) for i in (0, 4, 8)] == [1, 1, 1] and len(set(got)) == 3 and "" not in got
    short = groups(["a" * 300 + "x", "a" * 300 + "y", "b", "c" * 100 + "1", "c" * 100 + "2"])
    assert short[0] == short[1] != "" and short[2:] == ["", "", ""]  # 100 shared characters: no group
    assert groups(["a" * 300 + "z", "a" * 300 + "w"])[0] == short[0]  # the id is the shared text's


def test_each_group_goes_to_the_reader_that_took_its_first_jobs(r: redis.Redis) -> None:
    """Two consumers reading in turn, a few jobs at a time (the way two workers with free KV do): every
    group's jobs end with one of them, each job delivered once and pending under the one that got it,
    counted as its first delivery."""
    seed = fresh_seed()
    lines, names = few_shot_lines(random.Random(seed), 6, 6, 3)
    group_of = {f"q{n}": g for n, g in enumerate(names)}
    b = submit(lines, r=r, model="q")
    got: dict[str, list[commands.Delivery]] = {"a": [], "b": []}
    for _ in range(40):
        for c in ("a", "b"):
            got[c] += _read(r, c, 2)
    seen = [d.entry_id for ds in got.values() for d in ds]
    assert len(seen) == len(set(seen)) == len(lines), (seed, len(seen), len(set(seen)))
    assert {d.deliveries for ds in got.values() for d in ds} == {1}, seed
    for c, ds in got.items():
        assert held_by(r, b.id, c) == len(ds), seed
    split = {g: cs for g, cs in _owners(got, group_of).items() if len(cs) > 1}
    assert not split, (seed, split)
    assert got["a"] and got["b"], seed  # both worked: groups are spread, not all given to the first reader
    assert r.zcard(keys.handoff(b.id, 0)) == 0


def test_a_quiet_owners_group_is_split_and_its_handed_jobs_taken_once(r: redis.Redis) -> None:
    """The owner stops reading (its engine is full, or it died): after QUIET_S another reader takes the
    jobs handed to it and the rest of its group. Its own claim never takes a job handed to it (PULL gives
    those), another's claim of a dead owner's jobs takes them off the handoff set: each job once."""
    seed = fresh_seed()
    lines, names = few_shot_lines(random.Random(seed), 2, 8, 3)
    group_of = {f"q{n}": g for n, g in enumerate(names)}
    b = submit(lines, r=r, model="q")
    first = _read(r, "a", 2)
    second = _read(r, "b", 3)  # the rest of a's group is handed to a, then b starts the other group
    assert {group_of[d.job.custom_id or ""] for d in first}.isdisjoint(
        group_of[d.job.custom_id or ""] for d in second), seed
    handed = r.zcard(keys.handoff(b.id, 0))
    assert handed >= 1, seed
    # a's own claim (as after a restart) leaves the jobs handed to it: they are not running anywhere yet
    r.set(keys.heartbeat("b"), "1")  # b lives: its jobs are not orphans
    own = commands.claim(r, _queue("q"), "a", 10, {d.entry_id for d in first})
    assert own.deliveries == [], seed
    r.hset(keys.readers(b.id), "a", time.time() - 10 * commands.QUIET_S)  # a went quiet
    taken = _read(r, "b", 100)
    everything = first + second + taken
    ids = [d.entry_id for d in everything]
    assert len(ids) == len(set(ids)) == len(lines), (seed, len(ids), len(set(ids)))
    assert {d.deliveries for d in taken} == {1}, seed  # handing along is not a delivery
    assert r.zcard(keys.handoff(b.id, 0)) == 0 and held_by(r, b.id, "b") == len(second) + len(taken), seed
    # a is dead (no heartbeat): b's claim takes what a still held, once
    orphans = commands.claim(r, _queue("q"), "b", 10, {d.entry_id for d in second + taken})
    assert sorted(d.entry_id for d in orphans.deliveries) == sorted(d.entry_id for d in first), (seed, [(d.entry_id, d.job.custom_id) for d in orphans.deliveries], [(d.entry_id, d.job.custom_id) for d in first])
    assert held_by(r, b.id, "a") == 0


def test_a_dead_owners_handed_jobs_are_claimed_once(r: redis.Redis) -> None:
    """The owner dies with jobs handed to it: the claim of its orphans takes them off the handoff set, so
    a later read does not hand them out a second time."""
    seed = fresh_seed()
    lines, _ = few_shot_lines(random.Random(seed), 2, 8, 3)
    b = submit(lines, r=r, model="q")
    first, second = _read(r, "a", 2), _read(r, "b", 3)
    assert r.zcard(keys.handoff(b.id, 0)) >= 1, seed
    orphans = commands.claim(r, _queue("q"), "b", 100, {d.entry_id for d in second})
    assert r.zcard(keys.handoff(b.id, 0)) == 0, seed
    r.hset(keys.readers(b.id), "a", time.time() - 10 * commands.QUIET_S)
    rest = _read(r, "b", 100)
    # a died holding ``first`` and the jobs handed to it: b gets each of them, and every other job, once
    ids = [d.entry_id for d in second + orphans.deliveries + rest]
    assert len(ids) == len(set(ids)) == len(lines), (seed, len(ids), len(set(ids)))
    assert {d.entry_id for d in first} <= {d.entry_id for d in orphans.deliveries}, seed


def test_two_workers_keep_groups_apart_and_survive_a_death(r: redis.Redis, tiny_model_dir: Path,
                                                           tmp_path: Path) -> None:
    """Two real workers on a planned batch of few-shot groups; one is killed (-9) while it holds jobs. The
    other claims them: each job completes once, with the same text as one in-process worker gives (greedy);
    before the kill, most groups ran on one worker only."""
    seed = fresh_seed()
    lines, names = few_shot_lines(random.Random(seed), 6, 6, 4)
    b = submit(lines, r=r, model="tiny")
    args = ("--max-num-seqs", "2", "--lookahead", "0")
    w1 = worker_process(tiny_model_dir, "w1", *args, log=tmp_path / "w1.log", paced=True)
    w2 = worker_process(tiny_model_dir, "w2", *args, log=tmp_path / "w2.log", paced=True)
    try:
        wait_for(lambda: r.hlen(keys.done(b.id)) >= 12 and held_by(r, b.id, "w1") > 0, 300, "w1 holding jobs")
        before = result_entries(r, b.id)
        w1.kill()
        w1.wait()
        wait_for(lambda: r.hget(keys.meta(b.id), "status") == "completed", 300, "the batch to finish")
    finally:
        for w in (w1, w2):
            w.kill()
            w.wait()
    entries = assert_exactly_once(r, b.id, len(lines))
    assert {e["status"] for e in entries} == {"completed"}, entries[0]
    by_group: dict[str, set[str]] = defaultdict(set)
    for e in before:
        by_group[names[int(e["custom_id"][1:])]].add(e["worker"])
    one = sum(len(ws) == 1 for ws in by_group.values())
    print(f"seed={seed} groups before the kill: {len(by_group)}, on one worker: {one}")
    assert one * 2 > len(by_group), (seed, dict(by_group))
    ref = submit(lines, r=r, model="tiny")
    run_to_end(r, ref.id, tiny(tiny_model_dir), timeout=300)
    texts = {e["custom_id"]: e["text"] for e in result_entries(r, ref.id)}
    assert {e["custom_id"]: e["text"] for e in entries} == texts, seed


def test_an_idle_worker_waits_for_jobs_handed_to_a_quiet_owner(r: redis.Redis, tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    """A worker started with --exit-when-idle does not exit while jobs of its queue wait handed to another
    worker that reads no more (they would be left to nobody): once the owner is quiet it takes them."""
    seed = fresh_seed()
    lines, names = few_shot_lines(random.Random(seed), 3, 5, 3)
    b = submit(lines, r=r, model="tiny")
    stream, s = keys.jobs(b.id, 0), Scripts(r)
    first = _read(r, "ghost", 2, model="tiny")  # ghost owns the first group, and lives (a heartbeat)
    r.set(keys.heartbeat("ghost"), "1", ex=600)
    ghost_group = names[int(first[0].job.custom_id[1:])]
    others = sum(1 for g in names if g != ghost_group)

    def ghost_reads() -> None:  # a read of nothing: ghost stays a live reader of the batch
        script.pull(s, stream, "ghost", 0, time.time(), commands.QUIET_S, commands.HANDOFF_MAX, commands.HAND_MOST)

    w = worker_process(tiny_model_dir, "w", "--exit-when-idle", "1", log=tmp_path / "w.log")
    try:
        wait_for(lambda: ghost_reads() or r.hlen(keys.done(b.id)) >= others, 300, "the other groups done")
        assert r.zcard(keys.handoff(b.id, 0)) == len(lines) - others - 2, seed  # ghost's group waits for it
        end = time.monotonic() + 3.0  # three times the idle exit: w has nothing else to do
        while time.monotonic() < end:
            ghost_reads()
            time.sleep(0.2)
        assert w.poll() is None, (seed, (tmp_path / "w.log").read_text()[-2000:])
        # ghost goes quiet: w takes what was handed to it
        wait_for(lambda: r.hlen(keys.done(b.id)) >= len(lines) - 2, 300, "the handed jobs done by w")
        r.delete(keys.heartbeat("ghost"))  # and ghost dies: its own two jobs are claimed
        wait_for(lambda: r.hget(keys.meta(b.id), "status") == "completed", 300, "the batch to finish")
        assert w.wait(timeout=120) == 0
    finally:
        w.kill()
        w.wait()
    assert_exactly_once(r, b.id, len(lines))


def test_a_read_of_a_deleted_batch_leaves_no_key_behind(r: redis.Redis) -> None:
    """A reader holding a stale list of streams reads a batch deleted meanwhile (an online request's, gone
    once answered): the affinity bookkeeping writes nothing, so no key of the batch outlives it."""
    lines, _ = few_shot_lines(random.Random(0), 2, 3, 3)
    b = submit(lines, r=r, model="q")
    stale = commands.ready(r, _queue("q"))
    r.delete(*keys.batch_keys(b.id, [0]))
    assert commands.read(r, _queue("q"), "a", 4, stale).deliveries == []
    assert r.keys(f"*{b.id}*") == []
