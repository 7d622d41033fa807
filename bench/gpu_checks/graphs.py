"""Section 4: decode steps with CUDA graphs on and off, in their own process."""

from __future__ import annotations

import json
import time
from typing import Any

from bench.gpu_checks.common import Plan, Reporter
from bench.gpu_checks.models import emit


def child_graphs(plan: Plan, model_dir: str, work: list[tuple[list[int], int]]) -> None:
    """Decode step time per batch size with the engine's CUDA graphs on, then with enforce_eager; and the
    greedy tokens of both. On CPU (dry run) "graphs" means padded buckets run eagerly."""
    import gc

    import torch
    from sluice.engine.llm import LLM

    cuda = plan.device == "cuda"
    report: dict[str, Any] = {}
    for mode in ("graphs", "eager"):
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        kwargs = {"attention_backend": "triton", **plan.graph_kwargs}
        llm = LLM(model=model_dir, dtype=plan.model_dtype, enforce_eager=mode == "eager", pad_decode=mode == "graphs",
                  **kwargs)
        runner = llm.runner.decode_runner
        info: dict[str, Any] = {
            "init_s": time.perf_counter() - t0, "kv_blocks": llm.num_total_blocks,
            "captured": sorted(runner.graphs) if runner is not None else [],
            "capture_s": getattr(runner, "capture_s", None), "pool_bytes": getattr(runner, "pool_bytes", None),
            "reserve_bytes": llm.runner.graph_reserve_bytes,
            "capture_error": getattr(runner, "capture_error", None),
        }
        info["step_ms"], info["tokens"] = _time_decode_steps(plan, llm, mode)
        report[mode] = info
        emit("PROGRESS", {mode: {k: v for k, v in info.items() if k != "tokens"}})
        del llm, runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    emit("RESULT", report)


def _time_decode_steps(plan: Plan, llm: Any, mode: str) -> tuple[dict[str, float], dict[str, list[int]]]:
    """For each batch size: prefill that many prompts, then time ``graph_steps`` whole engine steps in
    which every sequence decodes (scheduling, inputs, forward, sampling, detokenizing). No sequence may
    finish or wait while the clock runs (max_tokens reaches the length limit; all are aborted after):
    each timed step is checked to run exactly ``b`` sequences, every one of them a decode."""
    import torch
    from sluice.engine.outputs import Request
    from sluice.engine.sampling_params import SamplingParams

    step_ms: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    steps = plan.graph_steps
    room = llm.max_model_len - plan.graph_context - 1  # no sequence stops while the clock runs
    assert room >= steps + 2, f"max_model_len {llm.max_model_len} leaves no room for {steps} timed steps"
    for b in plan.graph_batches:
        ids = [f"{b}-{i}" for i in range(b)]
        for i, rid in enumerate(ids):
            prompt = [100 + (7 * i + j) % 40000 for j in range(plan.graph_context)]
            llm.add_request(Request(rid, prompt_token_ids=prompt,
                                    params=SamplingParams(max_tokens=room, ignore_eos=True)))
        seqs = [s for rid in ids for s in llm.requests[rid].seqs]
        while any(s.num_output_tokens == 0 for s in seqs):  # prompts, then one decode step to warm up
            llm.step()
        llm.step()
        runner = llm.runner.decode_runner
        bucket_steps = sum(runner.steps.values()) if runner is not None else 0
        before = [s.num_output_tokens for s in seqs]
        if plan.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            llm.step()
        if plan.device == "cuda":
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        grew = {s.num_output_tokens - n for s, n in zip(seqs, before, strict=True)}
        if grew != {steps} or llm.num_running != b or llm.num_waiting != 0:
            raise AssertionError(f"B={b} {mode}: the batch changed while timed (tokens per sequence {sorted(grew)}, "
                                 f"{llm.num_running} running, {llm.num_waiting} waiting)")
        if runner is not None and sum(runner.steps.values()) - bucket_steps != steps:
            raise AssertionError(f"B={b} {mode}: {sum(runner.steps.values()) - bucket_steps} of {steps} timed steps "
                                 "went through the padded decode path")
        step_ms[str(b)] = elapsed / steps * 1e3
        tokens.update({s.request_id: s.output_token_ids for s in seqs})
        for rid in ids:
            llm.abort(rid)
    return step_ms, tokens


def graphs_rows(res: dict[str, Any], rows: Reporter) -> None:
    """One row per batch size (graphs vs eager step time), then capture cost and token agreement."""
    g, e = res.get("graphs"), res.get("eager")
    if not g or not e:
        rows.append(("graphs", "graphs vs eager", "INCOMPLETE", f"{res.get('status')}: {json.dumps(res)[:160]}"))
        return
    for b, ms in g["step_ms"].items():
        eager = e["step_ms"].get(b)
        speed = f"{eager / ms:.2f}x" if eager else "n/a"
        rows.append(("graphs", f"decode step B={b}", f"{ms:.2f} ms vs eager {eager:.2f} ms",
                     f"speed-up {speed}; {b} sequences decoding in every timed step (checked)"),
                    batch=int(b), graph_ms=ms, eager_ms=eager)  # fmt: skip
    mib = 1 << 20
    pool = g.get("pool_bytes")
    rows.append(("graphs", "capture", f"{len(g['captured'])} buckets in {g.get('capture_s') or 0:.1f}s",
                 f"graph pool {pool / mib if pool is not None else float('nan'):.0f} MiB, reserve left by KV sizing "
                 f"{(g.get('reserve_bytes') or 0) / mib:.0f} MiB; KV blocks {g['kv_blocks']} vs eager {e['kv_blocks']}"
                 + (f"; capture FAILED: {g['capture_error']}" if g.get("capture_error") else "")),
                pool_bytes=pool, reserve_bytes=g.get("reserve_bytes"), capture_error=g.get("capture_error"))  # fmt: skip
    common = [k for k in g["tokens"] if k in e["tokens"]]
    same = sum(g["tokens"][k] == e["tokens"][k] for k in common)
    rows.append(("graphs", "greedy tokens", f"{same}/{len(common)} sequences identical",
                 "informative only: bf16 near-ties on random weights may differ (the engine section compares logits)"),
                identical=same, of=len(common))
