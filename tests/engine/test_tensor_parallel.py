"""Tensor parallelism (engine/parallel/): two gloo ranks on the CPU give greedy tokens identical to one
rank in float32 (native Llama and Qwen3; Qwen3-MoE on the transformers path, by transformers' own plan),
under preemption, chunked prefill and prefix caching at once; a rank killed mid-batch
takes its worker down, and every job still completes exactly once."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import fresh_seed, make_tiny_model, random_prompts
from jobs_helpers import assert_exactly_once, held_by, prompt_lines, wait_for, worker_process
from sluice.engine.llm import LLM
from sluice.engine.outputs import Request
from sluice.engine.parallel.worker_procs import EXIT_RANK_DIED
from sluice.engine.sampling_params import SamplingParams
from sluice.jobs.store import get_batch, list_workers
from sluice.jobs.submit import submit

pytest_plugins = ["jobs_fixtures"]

MODELS = {
    # Biases on q/k/v and o and on the MLP (row-parallel biases are added once, after the sum), tied
    # embeddings, and a vocabulary that two ranks split unevenly (the last rank's slice is short).
    "llama-bias-tied-odd-vocab": dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                                      mlp_bias=True, tie_word_embeddings=True, vocab_size=49155),
    # Per-head q/k norms, on the PyTorch attention (its per-step groups are prepared on every rank).
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # The transformers path: transformers' own tensor-parallel plan (DTensor), its experts split too.
    "qwen3-moe-transformers": dict(model_type="qwen3_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}
BACKEND = {"llama-bias-tied-odd-vocab": "cpu", "qwen3": "torch", "qwen3-moe-transformers": "cpu"}
MAX_NEW = 20
NUM_BLOCKS = 14


def _settings(tp: int, backend: str) -> dict[str, Any]:
    # Each rank holds half the KV heads: half the bytes buy the same 14 blocks, too few for 8 sequences of
    # up to ~80 tokens (preemption); a 16-token budget cuts every prompt into chunks.
    kv_bytes = NUM_BLOCKS * 2 * 2 * 16 * 2 * 16 * 4 // tp
    return dict(dtype="float32", tensor_parallel_size=tp, kv_cache_memory=kv_bytes, max_num_seqs=8,
                max_num_batched_tokens=16, attention_backend=backend, block_size=16)


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [Request(f"r{i}", prompt_token_ids=p, params=SamplingParams(max_tokens=MAX_NEW)) for i, p in enumerate(prompts)]
    out = llm.generate(reqs)
    assert all(c.error is None for c in out)
    return [c.token_ids for c in out]


@pytest.mark.parametrize("name", list(MODELS))
def test_two_ranks_match_one_under_preemption_chunked_prefill_and_prefix_caching(name: str, tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", seed=3, **MODELS[name])
    rng = random.Random(fresh_seed())
    system = random_prompts(rng, 1, 33, 33)[0]  # two whole blocks every prompt shares
    prompts = [system + tail for tail in random_prompts(rng, 8, 1, 25)]
    results, stats = {}, {}
    for tp in (1, 2):
        llm = LLM(str(path), **_settings(tp, BACKEND[name]))
        try:
            assert llm.num_total_blocks == NUM_BLOCKS
            assert llm.parallelism == ("one device" if tp == 1 else "tensor parallel 2 (gloo)")
            assert llm.model_impl == ("transformers" if "moe" in name else "native")
            # Twice: the second round finds the shared prompt's blocks left by the first.
            results[tp] = _generate(llm, prompts) + _generate(llm, prompts[:3])
            stats[tp] = llm.stats
            assert llm.num_free_blocks == llm.num_total_blocks
        finally:
            llm.close()
    assert results[2] == results[1]
    for tp in (1, 2):
        assert stats[tp]["preemptions"] > 0 and stats[tp]["prefix_cache_hit_tokens"] >= 32, stats[tp]


def test_what_cannot_be_split_is_refused_in_one_line(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", seed=0, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 3 does not divide the model's num_attention_heads \(4\)$"):
        LLM(str(path), dtype="float32", tensor_parallel_size=3, kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size 3 does not divide the model's num_attention_heads"):
        LLM(str(path), dtype="float32", tensor_parallel_size=3, model_impl="transformers", kv_cache_memory=1 << 20)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(str(path), dtype="float32", tensor_parallel_size=0)


def test_a_rank_killed_mid_batch_takes_its_worker_down_and_every_job_completes_once(
        r: redis.Redis, tiny_model_dir: Path, tmp_path: Path) -> None:
    rng = random.Random(fresh_seed())
    n = 120
    b = submit(prompt_lines(n, rng, max_tokens=12), r=r, model="tiny")
    log = tmp_path / "worker.log"
    args = ("--max-num-seqs", "12", "--kv-cache-memory", str(2 << 20), "--max-deliveries", "10")
    # Paced: ~100 steps (2 s at the least) are left at 20% done, so the rank dies mid-batch on any machine.
    p = worker_process(tiny_model_dir, "w1", *args, "--tensor-parallel-size", "2", log=log, paced=True)
    try:
        wait_for(lambda: _done(r, b.id) >= 0.2 * n or p.poll() is not None,
                 240, "20% done")
        assert p.poll() is None, log.read_text()[-3000:]
        assert held_by(r, b.id, "w1") > 0  # the worker dies holding jobs
        beat = [w for w in list_workers(r) if w.queue == "tiny"]
        assert [w.parallelism for w in beat] == ["tensor parallel 2 (gloo)"]
        rank1 = int(re.findall(r"tensor parallel: rank 1 is pid (\d+)", log.read_text())[-1])
        _kill(rank1)
        assert p.wait(timeout=30) == EXIT_RANK_DIED, log.read_text()[-3000:]
    finally:
        p.kill()
        p.wait()
    assert "tensor-parallel rank 1" in log.read_text() and "died" in log.read_text()
    wait_for(lambda: not _alive(rank1), 10, "rank 1 to be gone")
    p = worker_process(tiny_model_dir, "w2", *args, "--exit-when-idle", "2", log=log)
    try:
        wait_for(lambda: _final(r, b.id), 240, "the batch to finish")
        assert p.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        p.kill()
    assert get_batch(r, b.id).status == "completed"
    entries = assert_exactly_once(r, b.id, n)
    assert all(e["status"] == "completed" for e in entries)


def _done(r: redis.Redis, batch_id: str) -> int:
    from sluice.jobs import keys

    return r.hlen(keys.done(batch_id))


def _final(r: redis.Redis, batch_id: str) -> bool:
    b = get_batch(r, batch_id)
    return b is not None and b.is_final


def _kill(pid: int) -> None:
    import os
    import signal

    os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Running (a zombie that no one reaped yet counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


_COLLECTIVE_FAILS = """
import subprocess, sys
from sluice.engine.parallel.worker_procs import DriverModel, RankProcesses
procs = RankProcesses.__new__(RankProcesses)  # no ranks spawned, no watchdog: only the collective path can act
procs.stopping = False
procs.procs = {{1: subprocess.Popen([sys.executable, "-c", "{rank}"])}}
model = DriverModel.__new__(DriverModel)
model.procs = procs
if {dead}:
    procs.procs[1].wait()  # dead before the collective fails, however slowly this machine starts a process
with model._collectives():
    raise RuntimeError("Connection closed by peer")
"""


@pytest.mark.parametrize("rank_dies", [True, False])
def test_a_collective_that_fails_because_a_rank_died_ends_the_worker_as_a_rank_death(rank_dies: bool) -> None:
    """Injected: a collective fails (gloo: "Connection closed by peer") before the watchdog, which polls, has
    seen the rank's death. The worker must exit with EXIT_RANK_DIED, not report a sick engine (seen in a
    fresh-clone run under load); an error with every rank alive is raised as it is."""
    code = _COLLECTIVE_FAILS.format(rank="pass" if rank_dies else "import time; time.sleep(10)", dead=rank_dies)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if rank_dies:
        assert out.returncode == EXIT_RANK_DIED and "rank 1" in out.stderr, out.stderr
    else:
        assert out.returncode == 1 and "Connection closed by peer" in out.stderr, out.stderr


_DIES_BEFORE_JOINING = """
import torch
from sluice.engine.config import EngineConfig
from sluice.engine.parallel import worker_procs

# Rank 1 dies before it joins the group: it sets its thread count (refused: -1) before the rendezvous.
worker_procs.rank_threads = lambda device, world: -1
worker_procs.start(None, lambda net, ps: net, "unused", None, EngineConfig(tensor_parallel_size=2), "aten",
                   torch.float32, torch.device("cpu"), 64)
print("rank 0 went on without rank 1")
"""


def test_a_rank_dead_before_joining_the_group_ends_rank_0_instead_of_leaving_it_waiting() -> None:
    """Injected: rank 1 fails before the group's rendezvous. Rank 0 sat in init_process_group for its 10-minute
    timeout, then in the metadata group's, which has none; now the worker exits as on any rank's death."""
    out = subprocess.run([sys.executable, "-c", _DIES_BEFORE_JOINING], capture_output=True, text=True, timeout=120)
    assert out.returncode == EXIT_RANK_DIED, (out.returncode, out.stderr[-2000:])
    assert "rank 1" in out.stderr and "set_num_threads" in out.stderr, out.stderr[-2000:]
