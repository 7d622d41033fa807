"""Block manager: chained prefix hashes, shared blocks, eviction order, never a leak."""

from __future__ import annotations

import random

from helpers import fresh_seed
from sluice.engine.block_manager import BlockManager
from sluice.engine.sampling_params import SamplingParams
from sluice.engine.sequence import Sequence


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(i, f"r{i}", 0, list(tokens), len(tokens), SamplingParams())


def _admit(bm: BlockManager, seq: Sequence) -> list[int]:
    hits = bm.match_prefix(seq)
    n = seq.num_tokens - len(hits) * bm.block_size
    assert bm.can_admit(seq, hits, n)
    bm.admit(seq, hits)
    assert bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    return hits


def test_shared_prefix_blocks_are_reused_and_ref_counted() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _seq(0, list(range(10)))  # blocks: [0-3] [4-7] [8,9]
    _admit(bm, a)
    b = _seq(1, list(range(8)) + [99, 98, 97])
    assert _admit(bm, b) == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert b.num_cached_tokens == 8
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 10
    assert all(blk.ref_count == 0 for blk in bm.blocks)


def test_same_block_after_a_different_prefix_is_not_a_hit() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    _admit(bm, _seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # The second block's tokens match, but its prefix differs: the chained hash tells them apart.
    assert bm.match_prefix(_seq(1, [9, 9, 9, 9, 5, 6, 7, 8, 0])) == []


def test_freed_blocks_stay_cached_until_reused_and_the_last_token_is_always_computed() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    a = _seq(0, list(range(8)))
    _admit(bm, a)
    bm.free_seq(a)
    again = _seq(1, list(range(8)))
    # Both blocks are cached, but the last token's block is recomputed (its logits are needed).
    assert len(bm.match_prefix(again)) == 1
    longer = _seq(2, list(range(9)))
    assert len(bm.match_prefix(longer)) == 2
    # Filling the cache with other tokens evicts them (least recently freed first).
    _admit(bm, _seq(3, [50 + i for i in range(16)]))
    assert bm.match_prefix(longer) == []


def test_allocation_fails_cleanly_when_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    a = _seq(0, list(range(8)))
    _admit(bm, a)
    b = _seq(1, [7] * 3)
    assert not bm.can_admit(b, [], 3)
    assert not bm.allocate_slots(a, 1)  # a's ninth token needs a third block
    assert len(a.block_table) == 2


def test_block_table_rows_follow_growth_replacement_and_departures() -> None:
    """Rows mirror each scheduled sequence's table: appended blocks are copied in, a replaced table
    (preemption, re-admission) is rewritten whole, and a departed sequence's row is reused."""
    from sluice.engine.block_table import BlockTableRows

    rng = random.Random(fresh_seed())
    rows = BlockTableRows(capacity=2, width=2)
    seqs = [_seq(i, [1]) for i in range(6)]
    for _ in range(300):
        for s in seqs:
            r = rng.random()
            if r < 0.3:
                s.block_table.append(rng.randrange(1000))
            elif r < 0.35:
                s.block_table = [rng.randrange(1000) for _ in range(rng.randrange(4))]
        scheduled = rng.sample(seqs, rng.randint(1, len(seqs)))
        idx = rows.rows_for(scheduled)
        assert len(set(idx.tolist())) == len(scheduled)
        for s, i in zip(scheduled, idx.tolist(), strict=True):
            assert rows.table[i, : len(s.block_table)].tolist() == s.block_table


def test_a_readmitted_sequence_counts_no_cache_hits_for_its_own_blocks() -> None:
    """Preempted before its first token and admitted again, a sequence finds the blocks it computed itself
    still cached: those are not prompt tokens served from the cache (usage.cached_tokens counted them, so
    a batch's prompt tokens computed looked smaller than the work done)."""
    bm = BlockManager(num_blocks=10, block_size=4)
    a = _seq(0, list(range(10)))
    _admit(bm, a)
    assert a.num_cached_tokens == 0
    bm.free_seq(a)  # preempted: its blocks go back to the free list, still hashed
    a.num_computed_tokens = 0
    assert _admit(bm, a) == [bm.hash_to_block[h] for h in a.block_hashes[:2]]
    assert a.num_cached_tokens == 0 and bm.hit_tokens == 0
    b = _seq(1, list(range(8)) + [7, 7])  # another sequence's hits still count
    _admit(bm, b)
    assert b.num_cached_tokens == 8 and bm.hit_tokens == 8
