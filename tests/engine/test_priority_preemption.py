"""An urgent request (the API's online requests run at the interactive priority) preempts running batch
sequences when the KV cache or the sequence slots are full (issue 43, item 7): it has its first token
within a step or two instead of waiting for a running sequence to finish, and every output, the preempted
ones included, is token-identical to an undisturbed run (greedy)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from helpers import fresh_seed
from reliability_helpers import tiny
from sluice.engine.outputs import Request
from sluice.engine.sampling_params import SamplingParams

pytest_plugins = ["jobs_fixtures"]

LONG = 48  # tokens each batch request generates


def _requests(rng: random.Random, n: int, priority: int = 0, prefix: str = "b",
              length: tuple[int, int] = (20, 40)) -> list[Request]:
    return [Request(f"{prefix}{i}", prompt_token_ids=[rng.randrange(1, 500) for _ in range(rng.randint(*length))],
                    params=SamplingParams(max_tokens=LONG, ignore_eos=True), priority=priority) for i in range(n)]


def _full(llm: Any, urgent: Request) -> bool:
    """Whether ``urgent`` can start only by preempting: every sequence slot taken, or fewer free KV blocks
    than its prompt needs (a cache with a block to spare would take a short prompt at once)."""
    need = -(-(len(urgent.prompt_token_ids or []) + 1) // llm.block_manager.block_size)
    return llm.num_running >= llm.config.max_num_seqs or llm.num_free_blocks < need


def _run(llm: Any, batch: list[Request], urgent: Request) -> tuple[dict[str, list[int]], int]:
    """The batch fills the engine, then ``urgent`` arrives: every output, and the steps ``urgent`` waited
    for its first token."""
    for req in batch:
        llm.add_request(req)
    out: dict[str, list[int]] = {}
    while llm.num_waiting or not _full(llm, urgent):  # everything it can run is running, nothing to spare
        assert llm.num_running or llm.num_waiting, "the batch ended before the engine was full"
        out |= {c.request_id: c.outputs[0].token_ids for c in llm.step()}
    llm.add_request(urgent)
    waited = 0
    while (llm.tokens_so_far(urgent.request_id) or (0, [[]]))[1][0][len(urgent.prompt_token_ids or []):] == [] \
            and urgent.request_id not in out:
        out |= {c.request_id: c.outputs[0].token_ids for c in llm.step()}
        waited += 1
    while llm.num_running or llm.num_waiting:
        out |= {c.request_id: c.outputs[0].token_ids for c in llm.step()}
    return out, waited


@pytest.mark.parametrize("full", ["slots", "kv_cache"])
def test_an_urgent_request_preempts_batch_sequences_and_all_outputs_stay_the_same(tiny_model_dir: Path,
                                                                                  full: str) -> None:
    seed = fresh_seed()
    rng = random.Random(seed)
    # The urgent prompt needs three KV blocks of 32: a cache down to its last block or two cannot take it.
    batch, urgent_req = _requests(rng, 12), _requests(rng, 1, prefix="u", length=(70, 90))[0]
    alone = tiny(tiny_model_dir, max_num_seqs=16, kv_cache_memory=8 << 20)
    want = {c.request_id: c.outputs[0].token_ids for c in alone.generate([*batch, urgent_req])}
    waits = {}
    per_block = (4 << 20) // tiny(tiny_model_dir).num_total_blocks  # bytes of one KV block
    for priority in (0, 100):
        # Four sequence slots; or slots for all, and KV blocks for about four sequences at full length.
        llm = tiny(tiny_model_dir, max_num_seqs=4, kv_cache_memory=8 << 20) if full == "slots" else \
            tiny(tiny_model_dir, max_num_seqs=16, kv_cache_memory=14 * per_block)
        urgent = Request(urgent_req.request_id, prompt_token_ids=urgent_req.prompt_token_ids,
                         params=urgent_req.params, priority=priority)
        got, waits[priority] = _run(llm, batch, urgent)
        assert got == want, (seed, priority)  # preempted sequences resume token for token
        if priority:
            assert llm.scheduler.num_preemptions > 0, seed
    print(f"seed={seed} {full} full: steps to the urgent request's first token: {waits[0]} as a batch request, "
          f"{waits[100]} at the interactive priority")
    assert waits[100] <= 2, (seed, waits)
    assert waits[0] > waits[100], (seed, waits)
