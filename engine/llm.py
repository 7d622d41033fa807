"""The engine's front door: requests in, completions out, one scheduler step at a time. No Redis here."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from sluice.engine.block_manager import BlockManager
from sluice.engine.build import build_runner, load_model, parallelism
from sluice.engine.chat_template import render_chat
from sluice.engine.config import EngineConfig
from sluice.engine.detokenizer import IncrementalDetokenizer
from sluice.engine.guided import GuidedDecoding
from sluice.engine.intake import Intake
from sluice.engine.outputs import Completion, CompletionOutput, Request, Timings, Usage
from sluice.engine.reasoning import attach_thinking, find_parser, split_output
from sluice.engine.render_queue import Rendering, RenderQueue
from sluice.engine.scheduler import ScheduledBatch, Scheduler
from sluice.engine.sequence import Sequence
from sluice.engine.startup_clock import StartupClock
from sluice.engine.vision import ImageItem, image_urls

log = logging.getLogger(__name__)

Rendered = tuple[list[int], list[ImageItem] | None]  # a prompt's token ids, and its images (None: none)


@dataclass
class _RequestState:
    request: Request
    prompt_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float


class LLM(Intake[_RequestState, Completion]):
    """``LLM(model=None, **config)``: see ``EngineConfig`` for the settings."""

    serves = "generation"  # engine/protocol.py: what a worker's heartbeat says it serves

    def __init__(self, model: str | None = None, **config: Any) -> None:
        super().__init__()
        clock = StartupClock()
        self.config = EngineConfig(model=model, **config)
        m = load_model(self.config, clock)  # engine/build.py: everything that loads
        self.device, self.dtype, self.model_impl, self.quantization = m.device, m.dtype, m.model_impl, m.quantization
        self.tokenizer, self.hf_config, self.text_config = m.tokenizer, m.hf_config, m.text_config
        self.lora, self.cpu_linear, self.eos_ids = m.lora, m.cpu_linear, m.eos_ids
        self.runner = build_runner(self.config, m, clock)
        self.vision = self.runner.vision
        num_blocks = self._allocate_kv_cache(m.max_len, clock)
        self.max_model_len = min(m.max_len, num_blocks * self.config.block_size)
        self.block_manager = BlockManager(num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config, self.block_manager, self.eos_ids, self.max_model_len)
        if self.lora is not None:
            self.lora.in_use = self.scheduler.lora_in_use  # never evicted from under a running sequence
        self.guided = GuidedDecoding(self.tokenizer, self.text_config.vocab_size, self.eos_ids)
        self.reasoning = find_parser(self.tokenizer, self.config.reasoning_parser)  # think delimiters, or None
        self.unrendered: RenderQueue[Rendered] = RenderQueue(self._render, torch.get_num_threads())
        self._seq_ids = itertools.count()
        self.num_steps = 0
        self.max_running_seen = 0
        clock.lap("rest")
        self.startup = clock
        log.info("%s", clock.line())

    # ---- the numbers a puller needs -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_manager.num_blocks

    @property
    def parallelism(self) -> str:
        """How the model is split, for the start-up line and the worker's heartbeat."""
        return parallelism(self.config.tensor_parallel_size, self.device)

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self.unrendered)

    @property
    def stats(self) -> dict[str, float]:
        return {
            "steps": self.num_steps,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_cache_hit_rate": self.block_manager.hit_rate,
            "prefix_cache_hit_tokens": self.block_manager.hit_tokens,
            "prompt_tokens": self.block_manager.query_tokens,
            "max_running": self.max_running_seen,
            "num_blocks": self.num_total_blocks,
            "images_encoded": self.vision.num_encoded if self.vision is not None else 0,
            "image_cache_hits": self.vision.num_cache_hits if self.vision is not None else 0,
        }

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one device); the engine cannot step afterwards."""
        self.unrendered.close()
        close = getattr(self.runner.model, "close", None)
        if close is not None:
            close()

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a request. One that is malformed or can never fit comes back from a later ``step()`` as a
        Completion with finish_reason "error"; nothing else is affected. A chat request with images has its
        prompt rendered when the scheduler nears it (engine/render_queue.py), so its errors come later."""
        arrival = time.time()
        if self._renders_later(request):
            try:
                self._check_new(request.request_id)
            except ValueError as e:
                self._reject(_error_completion(request, str(e), arrival))
                return
            self.unrendered.add(request, arrival)
            return
        self._admit(request, arrival)

    def _admit(self, request: Request, arrival: float, rendering: Rendering[Rendered] | None = None) -> None:
        """Check a request and hand its sequences to the scheduler (a bad one: its error completion)."""
        try:
            prompt_ids, images = self._prompt_ids(request, rendering)
            mrope = self.vision.rope_positions(prompt_ids, images or []) if self.vision is not None else None
            self._check_token_ids(request)
            self._check_fits(request, prompt_ids)
            self._check_lora(request)
            grammar = self.guided.compile(request.params)
        except ValueError as e:
            self._reject(_error_completion(request, str(e), arrival))
            return
        seqs = [self._make_seq(request, prompt_ids, i, arrival, images) for i in range(request.params.n)]
        for seq in seqs:  # computed once: the n samples share the table
            seq.mrope = mrope
        self.guided.attach(seqs, grammar)
        attach_thinking(seqs, self.reasoning, request, prompt_ids)
        self.requests[request.request_id] = _RequestState(request, prompt_ids, seqs, arrival)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort(self, request_id: str) -> Completion | None:
        """Stop a request now and free its blocks; returns its partial completion."""
        unrendered = self.unrendered.remove(request_id)
        if unrendered is not None:
            return _empty_completion(unrendered.request, unrendered.arrival, "abort")
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for seq in state.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
        return self._completion(state)

    def tokens_so_far(self, request_id: str) -> tuple[int, list[list[int]]] | None:
        """(prompt length, each sample's token ids so far, prompt first) of a request in flight, for a
        caller that streams text (None: not in flight). The lists are the engine's: read, never change."""
        state = self.requests.get(request_id)
        return None if state is None else (len(state.prompt_ids), [s.token_ids for s in state.seqs])

    def step(self) -> list[Completion]:
        """Run one iteration; return the requests that finished in it."""
        for r in self.unrendered.take(len(self.scheduler.waiting)):
            self._admit(r.request, r.arrival, r)
        done = self._take_rejected()
        batch = self.scheduler.schedule()
        done += self._fail_unloadable(batch)
        if not len(batch):
            return done
        self.num_steps += 1
        self.max_running_seen = max(self.max_running_seen, len(self.scheduler.running))
        sampled = self.runner.run(batch, self.scheduler.stop_ids, self.block_manager.num_touched)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
        self.scheduler.postprocess(sampled, time.time())
        # A request is done when its last sequence is: in the order of each request's last sampled one.
        last = {seq.request_id: i for i, (seq, _, _) in enumerate(sampled)}
        for i, (seq, _, _) in enumerate(sampled):
            rid = seq.request_id
            if last[rid] == i and all(s.is_finished for s in self.requests[rid].seqs):
                done.append(self._completion(self.requests.pop(rid)))
                if self.lora is not None and seq.lora is not None:
                    self.lora.count(seq.lora, done[-1].usage.prompt_tokens, done[-1].usage.completion_tokens)
        return done

    def generate(self, requests: Iterable[Request], on_finish: Callable[[Completion], None] | None = None,
                 on_step: Callable[[list[Completion], Callable[[], int]], None] | None = None) -> list[Completion]:
        """Run requests to completion; results in input order. ``on_finish`` sees each as it finishes;
        ``on_step`` (a progress bar: worker/progress.py) each step's finished ones, with a count of the
        tokens sampled so far (summed over the requests in flight, so only when asked)."""
        order = []
        for r in requests:
            self.add_request(r)
            order.append(r.request_id)
        results: dict[str, Completion] = {}
        finished_tokens = 0
        while self.has_unfinished():
            done = self.step()
            for c in done:
                results[c.request_id] = c
                finished_tokens += c.usage.completion_tokens
                if on_finish is not None:
                    on_finish(c)
            if on_step is not None:
                on_step(done, functools.partial(self._tokens_sampled, finished_tokens))
        return [results[rid] for rid in order]

    # ---- internals ------------------------------------------------------------------------------
    def _tokens_sampled(self, finished: int) -> int:
        """``finished`` (finished requests' tokens) plus those of the requests in flight."""
        return finished + sum(s.num_output_tokens for state in self.requests.values() for s in state.seqs)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.unrendered)

    def _in_flight(self, request_id: str) -> bool:
        return super()._in_flight(request_id) or request_id in self.unrendered

    def _renders_later(self, request: Request) -> bool:
        """A chat request with images: its rendering loads and processes them (engine/render_queue.py)."""
        return (self.vision is not None and request.prompt_token_ids is None and request.messages is not None
                and bool(image_urls(request.messages)))

    def _prompt_ids(self, request: Request, rendering: Rendering[Rendered] | None = None) -> Rendered:
        """The prompt's token ids, and a chat request's images (None: no images)."""
        self._check_new(request.request_id)
        if rendering is None:
            ids, images = self._render(request)
        elif rendering.error is not None:
            e = rendering.error
            raise e if isinstance(e, ValueError) else ValueError(f"rendering the prompt failed: {type(e).__name__}: {e}")
        else:
            assert rendering.result is not None
            ids, images = rendering.result
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids, images or None

    def _render(self, request: Request) -> Rendered:
        """The request's prompt as token ids, and its images; raises ValueError for a bad one."""
        images = None
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
        elif request.messages is not None and self.vision is not None:
            ids, images = self.vision.prompt(request)
        elif request.messages is not None:
            if image_urls(request.messages):
                raise ValueError(f"the model ({self.hf_config.model_type}) takes no images: it is not a vision-language model")
            ids = render_chat(self.tokenizer, request)
        elif request.prompt is not None:
            ids = self.tokenizer.encode(request.prompt)
        else:
            raise ValueError("a request needs prompt, messages or prompt_token_ids")
        return ids, images

    def _check_token_ids(self, request: Request) -> None:
        """Token ids a request names besides its prompt: outside the vocabulary they would index past
        the logits in the sampler and fail the whole step (every request in it)."""
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in request.params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")

    def _check_fits(self, request: Request, prompt_ids: list[int]) -> None:
        need = len(prompt_ids) + request.params.max_tokens
        blocks = self.block_manager.blocks_for(need)
        if blocks > self.num_total_blocks:
            raise ValueError(f"request needs {blocks} KV blocks but the whole cache has {self.num_total_blocks}")
        if need > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({request.params.max_tokens}) = {need} "
                             f"exceeds max_model_len {self.max_model_len}")

    def _check_lora(self, request: Request) -> None:
        if request.lora is None:
            return
        if self.lora is None:
            raise ValueError(f"LoRA adapter {request.lora!r} requested, but this engine serves none")
        self.lora.check(request.lora)  # a LoraError (a ValueError) fails this request only

    def _make_seq(self, request: Request, prompt_ids: list[int], index: int, arrival: float,
                  images: list[ImageItem] | None) -> Sequence:
        p = request.params
        # The n samples share their images' items: each image is encoded once for all of them.
        seq = Sequence(next(self._seq_ids), request.request_id, index, list(prompt_ids), len(prompt_ids), p,
                       arrival_time=arrival, lora=request.lora, priority=request.priority, images=images)
        seq.detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, p.stop)
        if p.logprobs is not None:
            seq.logprobs = []
        if p.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]
        return seq

    def _fail_unloadable(self, batch: ScheduledBatch) -> list[Completion]:
        """Requests whose adapter, checked when they came but out of memory since, cannot be read again now
        (its files removed or broken meanwhile): failed with the reason and taken out of the step's batch."""
        broken = self.lora.prepare([s.lora for s in batch.seqs]) if self.lora is not None else {}
        if not broken:
            return []
        failed = []
        for rid in dict.fromkeys(s.request_id for s in batch.seqs if s.lora in broken):
            state = self.requests.pop(rid)
            for seq in state.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "error")
            failed.append(_error_completion(state.request, broken[state.seqs[0].lora or ""], state.arrival_time))
        kept = [(s, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if s.lora not in broken]
        batch.seqs[:] = [s for s, _ in kept]
        batch.num_new_tokens[:] = [n for _, n in kept]
        return failed

    def _completion(self, state: _RequestState) -> Completion:
        outs = [CompletionOutput(s.index, s.detok.text if s.detok else "", s.output_token_ids, s.finish_reason or "abort",
                                 s.logprobs) for s in state.seqs]
        for out in outs:
            split_output(out, self.reasoning, state.request, state.prompt_ids, self.tokenizer)
        firsts = [s.first_token_time for s in state.seqs if s.first_token_time is not None]
        ends = [s.finish_time for s in state.seqs if s.finish_time is not None]
        usage = Usage(len(state.prompt_ids), sum(s.num_output_tokens for s in state.seqs),
                      state.seqs[0].num_cached_tokens)
        admitted = [s.admitted_time for s in state.seqs if s.admitted_time is not None]
        timings = Timings(state.arrival_time, min(firsts) if firsts else None, max(ends) if ends else time.time(),
                          min(admitted) if admitted else None)
        return Completion(state.request.request_id, outs, state.prompt_ids, usage, timings,
                          prompt_logprobs=state.seqs[0].prompt_logprobs)

    def _allocate_kv_cache(self, max_len: int, clock: StartupClock) -> int:
        """Allocate the KV cache the budget holds; returns its blocks."""
        num_blocks = self._num_blocks(max_len)
        self.runner.allocate_kv_cache(num_blocks)
        allocated_s = clock.lap("kv_cache")
        log.info("KV cache: %d blocks = %d tokens (%s, %s; %.1f GB, allocated in %.1f s)", num_blocks,
                 num_blocks * self.config.block_size, self.dtype, self.device,
                 num_blocks * self.runner.bytes_per_block() / 1e9, allocated_s)
        return num_blocks

    def _num_blocks(self, max_len: int) -> int:
        per_block = self.runner.bytes_per_block()
        budget = self.runner.kv_budget_bytes()
        blocks = budget // per_block
        # No use holding more than every sequence at full length could fill.
        blocks = min(blocks, self.config.max_num_seqs * -(-max_len // self.config.block_size))
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
        return int(blocks)


def _error_completion(request: Request, message: str, arrival: float) -> Completion:
    return _empty_completion(request, arrival, "error", message)


def _empty_completion(request: Request, arrival: float, finish: str, error: str | None = None) -> Completion:
    """A request's completion before any sequence of it ran: one empty output (a failed request), or one
    per sample (an aborted one)."""
    outs = [CompletionOutput(i, "", [], finish) for i in range(1 if error is not None else request.params.n)]
    return Completion(request.request_id, outs, list(request.prompt_token_ids or []), Usage(),
                      Timings(arrival, None, time.time()), error=error)

