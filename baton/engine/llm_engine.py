"""The engine: the one step loop (scheduler + model runner), shared by every role.

A request's life in the engine:
1. `add_request` checks the prompt (token ids, or text tokenized as is) and queues it in the
   scheduler's `waiting` queue; nothing is allocated yet. A COMPLETION role instead allocates
   through the scheduler itself (`allocate_prompted`) and registers the request with `track`.
2. `step()`: `schedule()` picks a batch (a prompt step, possibly one chunk of a long prompt, or a
   decode step over `running`) and allocates blocks; the model runner runs it, writing K/V into
   the pool, and samples the rows whose context is complete; `process_outputs` books the tokens.
3. When the pool runs out, the scheduler preempts the youngest sequence and puts it back in
   `waiting`; it is later prefilled again from prompt + tokens so far (recompute). A seeded
   draw depends only on (seed, sample_index, output position), so its output does not change.
4. EOS / stop token / max_tokens finish it (`process_outputs().finished`); `abort_request` finishes
   it at once. Either way its blocks go back to the pool and the last output says why. In PROMPT
   mode a finished prompt may instead leave with its blocks (`handed_off_block_ids`): the prompt
   role holds them under a lease and returns them with `Scheduler.release_handed_off`.
A migrated request (its engine failed mid-stream) arrives with the outputs it already had: they
are prefilled after the prompt and count as outputs (max_tokens, min_tokens, penalties, the
seed's position), so it goes on exactly as it would have.
Outputs are token ids; text is the router's business (and `generate`'s, offline).
This module is the loop and the verbs; its parts: input_processor.py (checks, a step's runner
arguments), output_processor.py (booked tokens -> outputs, n > 1 forks), kv_tiers.py (disk and
shared tiers), kv_keys.py (KV identity), pipeline.py (two-beat), speculation.py (drafts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from baton.engine.choices import for_choice, plan_splits
from baton.engine.config import EngineConfig
from baton.engine.input_processor import InputProcessor
from baton.engine.kv_disk import DiskTier
from baton.engine.kv_events import KvEventSource
from baton.engine.kv_keys import KvKeys
from baton.engine.kv_shared import SharedTier
from baton.engine.kv_tiers import KvTiers
from baton.engine.output_processor import OutputProcessor
from baton.engine.pipeline import StepLaunch, TwoBeat
from baton.engine.request import CompletionOutput, Request, RequestOutput, RequestTable
from baton.engine.runner_api import Runner
from baton.engine.scheduler import AllocStatus, Scheduler, kv_window
from baton.engine.speculation import Speculator
from baton.sampling.params import SamplingParams
from kv_transfer.protocol import Fingerprint

logger = logging.getLogger(__name__)


class LLMEngine:
    """Offline `generate`, and `add_request` / `step` / `abort_request` for a service loop."""

    def __init__(self, config: EngineConfig | None = None, loaded=None,
                 all_reduce_min: Callable[[int], int] | None = None,
                 runner: Runner | None = None, shared_store=None) -> None:
        """`shared_store`: the shared KV tier's client (a `baton.engine.kv_shared.BlockClient`,
        baton/ops/kv_store.py's RedisKvStore; docs/scheduler.md P11), None = no shared tier.
        `runner` runs the steps (a mock engine's, or a test's); without one the model of
        `config` is loaded (`loaded`, a `baton.model.loader.LoadedModel`, reuses one already
        loaded: tests, benchmarks; it must match `config`). Importing the engine core loads no
        torch: only building the default runner does. `all_reduce_min` joins a data-parallel
        group's step-type votes (baton/ops/dp.py)."""
        self.config = config = config or EngineConfig()
        if runner is None:
            from baton.model.runner import build_runner

            runner = build_runner(config, loaded)
        self.runner = runner
        self.model_config, self.tokenizer = runner.config, runner.tokenizer
        self.inputs = InputProcessor(self.tokenizer, self.model_config)
        self.model_path = runner.model_path
        self.kv_keys = KvKeys(config, runner)
        self.quantization = runner.quantization  # the mode it runs (auto resolved)
        logger.info("quantization %s (asked: %s), dtype %s", self.quantization,
                    config.quantization, config.dtype)
        num_blocks = self.runner.num_blocks
        # Never longer than the pool holds: such a prompt is refused at once, not left waiting.
        max_len = min(config.max_model_len or self.model_config.max_position,
                      self.model_config.max_position, (num_blocks - 1) * config.block_size)
        self.scheduler = Scheduler(config.scheduler_config(
            num_blocks, max_len, self.prefix_cache_seed,
            kv_window(getattr(self.model_config, "layer_windows", ()))),
            all_reduce_min=all_reduce_min)
        # Drafts for the next decode step (baton/engine/speculation.py); None = plain decoding.
        self.speculator = (Speculator(config.speculative, config.num_draft_tokens,
                                      disable_by_batch_size=config.speculative_disable_by_batch_size)
                           if config.num_draft_tokens else None)
        self.max_model_len = max_len
        # --async-scheduling: steps on a forward thread, one ahead where they may (pipeline.py)
        self.pipeline = TwoBeat(self) if config.async_scheduling else None
        self.requests = RequestTable()
        # A booked step's tokens -> each request's outputs (output_processor.py).
        self.output_processor = OutputProcessor(self.scheduler, self.requests,
                                                config.engine_type, self.track, self.untrack)
        self._pending: list[RequestOutput] = []  # final outputs of aborted requests
        self._next_id = 0
        self.num_recomputed = 0  # prompt steps that re-prefilled generated tokens (preemption)
        self.num_prompt_tokens = 0  # tokens run through prefill
        # Step types, so a data-parallel group can be seen to agree (S35): a rank with nothing
        # to prefill runs an empty prompt step while another prefills.
        self.num_prompt_steps = 0
        self.num_empty_prompt_steps = 0
        self.num_decode_steps = 0
        # Seconds of the `step()` calls that launched a prompt step (the rest of the service's
        # busy seconds are decode steps): the real engine's split of its busy time, which the
        # simulator keeps per engine (`prefill_busy_s`) and a speed probe divides by.
        self.prompt_busy_s = 0.0
        logger.info("engine: %s, model %s, %d KV blocks, max_model_len %d", config,
                    self.model_path, num_blocks, max_len)
        # The disk (P10) and shared (P11) tiers below the pool (kv_tiers.py).
        self.tiers = KvTiers(config, self.kv_keys, self.scheduler, self.runner, shared_store)

    @property
    def disk(self) -> DiskTier | None:
        return self.tiers.disk

    @property
    def shared(self) -> SharedTier | None:
        return self.tiers.shared

    @property
    def num_generated_tokens(self) -> int:
        """Tokens sampled."""
        return self.output_processor.num_generated_tokens

    # ------------------------------------------------------------------ KV identity (kv_keys.py)
    @property
    def model_fingerprint(self) -> str:
        return self.kv_keys.model_fingerprint

    @property
    def prefix_cache_seed(self) -> int:
        return self.kv_keys.prefix_cache_seed

    @property
    def kv_fingerprint(self) -> Fingerprint:
        return self.kv_keys.fingerprint

    def request_key_seed(self, request_id: str, cache_salt: str,
                         lora_name: str = "") -> int | None:
        return self.kv_keys.request_key_seed(request_id, cache_salt, lora_name)

    # ------------------------------------------------------------------ LoRA adapters
    def lora_adapters(self) -> dict[str, str]:
        return self.kv_keys.lora_adapters()

    def load_lora(self, name: str, path: str) -> str:
        """Load a PEFT LoRA adapter under `name`; its id. ValueError (baton.model.lora.LoraError)
        when the name is taken or the adapter does not fit the model."""
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise ValueError("this engine's runner serves no LoRA adapters (a mock runner)")
        return lora.load(name, path).adapter_id

    def unload_lora(self, name: str) -> None:
        """Unload adapter `name`; ValueError when it is not loaded or a request runs with it."""
        lora = getattr(self.runner, "lora", None)
        if lora is None or name not in lora.adapters:
            loaded = sorted(lora.adapters) if lora is not None else []
            raise ValueError(f"LoRA adapter {name!r} is not loaded (loaded: {loaded or 'none'})")
        users = sum(r.lora_name == name for r in self.requests.values())
        if users:
            raise ValueError(f"LoRA adapter {name!r} serves {users} running requests; unload "
                             "it when they are done")
        lora.unload(name)

    @property
    def kv_cache(self):
        """The paged KV pool (what the KV exporter / importer register with NIXL)."""
        return self.runner.kv_cache

    @property
    def kv_spec(self):
        return self.runner.kv_spec

    # ------------------------------------------------------------------ counters
    def num_free_blocks(self) -> int:
        return self.scheduler.num_free_blocks()

    def num_total_blocks(self) -> int:
        return self.scheduler.num_total_blocks()

    def reset_prefix_cache(self, pool_only: bool = False, shared: bool = False) -> bool:
        """Forget every cached-free block (vLLM's reset_prefix_cache) and, unless
        `pool_only`, every block of the disk tier; `shared`: delete this fingerprint's blocks
        from the shared tier too (every engine's: only when asked, P11). False, and nothing
        done, while a KV pull into an allocated block could still be pending."""
        if pool_only and shared:
            raise ValueError("pool_only and shared contradict each other")
        if not self.scheduler.reset_prefix_cache():
            return False
        self.tiers.reset(pool_only, shared)
        return True

    def close(self) -> None:
        """With a disk tier: the pool's cached blocks go to disk too, and the writer finishes,
        so that a restart (or the next role's engine, S41) finds them there (P10). With
        the two-beat pipeline, the step in flight is booked and its thread stopped first.
        The shared tier's threads stop (its blocks stay in the store, P11)."""
        if self.pipeline is not None:
            self.pipeline.close()
        self.tiers.close()

    def stats(self) -> dict[str, float]:
        """Counters for the engine's stats and registry record (pool, queues, prefix cache)."""
        sched = self.scheduler
        cache = sched.prefix_cache_stats()
        return {"num_free_blocks": sched.num_free_blocks(),
                "num_total_blocks": sched.num_total_blocks(),
                "num_running": sched.num_running(), "num_waiting": sched.num_waiting(),
                "num_preemptions": sched.num_preemptions(),
                "num_handed_off": sched.num_handed_off(),
                "prefix_cache_query_tokens": cache["query_tokens"],
                "prefix_cache_hit_tokens": cache["hit_tokens"],
                "num_cached_blocks": sched.num_cached_blocks()}

    def kv_event_source(self) -> KvEventSource:
        """The prefix cache's keys for cache-aware routing (baton/engine/kv_events.py)."""
        return KvEventSource(self.scheduler, self.config.block_size, self.prefix_cache_seed,
                             self.scheduler.num_total_blocks(), self.disk, self.shared)

    def tier_stats(self) -> dict[str, float]:
        """Hits, bytes and load time per KV tier (`baton_kv_tier_*`, kv_tiers.py)."""
        return self.tiers.stats()

    # ------------------------------------------------------------------ PROMPT: the hand-off
    def block_keys(self, request_id: str) -> list[int]:
        """A handed-off prompt's full blocks' prefix-cache keys (they name the blocks'
        contents whether or not this engine caches)."""
        return [int(k) for k in self.scheduler.block_keys(request_id)]

    def release_handed_off(self, request_id: str) -> None:
        """A handed-off prompt's lease ended: its blocks return to the pool (keyed ones stay
        in the prefix cache)."""
        self.scheduler.release_handed_off(request_id)

    # ------------------------------------------------------------------ COMPLETION: prompted
    def add_prompted_request(self, request_id: str, prompt_token_ids: list[int],
                             output_token_ids: list[int], params: SamplingParams,
                             first_token: int, first_logprob: float, index: int = 0,
                             block_keys: Sequence[int] = (), cache_salt: str = "",
                             lora_name: str = ""):
        """A prompt whose KV lives on a prompt engine: allocate its blocks (the run this
        engine's prefix cache holds, by `block_keys`, is pinned instead) and track it as
        waiting for its remote KV; it joins `running` at `commit_prompted`. Returns the
        scheduler's allocation (status OK / LATER / NEVER, block ids, cached blocks)."""
        seed = self.request_key_seed(request_id, cache_salt, lora_name)
        if len(block_keys):  # P10, P11: loaded, not pulled
            self.tiers.load_now(prompt_token_ids + output_token_ids, self.kv_keys.block_seed(seed))
        alloc = self.scheduler.allocate_prompted(
            request_id, prompt_token_ids + output_token_ids, first_token,
            params.max_tokens - len(output_token_ids), **self.inputs.stop_options(params),
            block_keys=block_keys if self.config.enable_prefix_caching else (),
            key_seed=seed)
        self.tiers.spill()  # the allocation may have evicted: out before the pull lands
        if alloc.status == AllocStatus.OK:
            self.track(request_id, prompt_token_ids, for_choice(params, params.sample_index, index),
                       alloc.seq_id, token_ids=[*output_token_ids, first_token],
                       logprobs=[first_logprob], index=index, lora_name=lora_name)
        return alloc

    def commit_prompted(self, request_id: str,
                        choices: Sequence[tuple[int, int, float]] = ()) -> None:
        """Its KV landed: it decodes from the next step; with n > 1 its other choices (index,
        first token, logprob) fork from it and share the blocks just pulled (S16)."""
        self.scheduler.commit_prompted(request_id)
        req = self.requests[request_id]
        for index, token, lp in choices:
            self.output_processor.fork(req, index, token, lp)
        self._propose([req])

    def free_prompted(self, request_id: str) -> None:
        """Its KV never landed (failed or aborted pull): blocks back, request forgotten."""
        self.scheduler.free_prompted(request_id)
        self.untrack(request_id)

    def has_unfinished(self) -> bool:
        """Work for `step()`: final outputs to send, or sequences in the scheduler's queues
        (finished ones too, until a step drops them). Prompts whose KV is still being pulled
        (COMPLETION) or has been handed off (PROMPT) need no step."""
        sched = self.scheduler
        return (bool(self._pending) or sched.num_waiting() > 0 or sched.num_running() > 0
                or sched.num_prompted() > 0
                or (self.pipeline is not None and self.pipeline.in_flight))

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None,
                    output_token_ids: Sequence[int] = (), cache_salt: str = "",
                    lora_name: str = "") -> str:
        """Queue a prompt (text is tokenized as is: apply a chat template first if wanted).
        `output_token_ids` were generated before, elsewhere (a migrated request): prefilled
        after the prompt, they count as this request's first outputs. `cache_salt`: its
        blocks hit and are keyed only among requests with the same salt (P1); `lora_name`:
        the LoRA adapter it runs with ("" = the base model), which keys its blocks too.
        Returns the request id (generated when None); ValueError on a duplicate or empty one."""
        params = params or SamplingParams()
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        ids, outputs = self.inputs.check_request(request_id, prompt, output_token_ids, params)
        # Prompt logprobs need the logits of every prompt position: a cached prefix has none.
        seed = self.request_key_seed(request_id, cache_salt, lora_name)
        skip = params.prompt_logprobs >= 0
        # P10, P11: blocks of it on disk (else in the shared tier) are read first; it waits
        # (S15) until they are in the pool.
        loading = self.tiers.plan(request_id, ids + outputs, self.kv_keys.block_seed(seed), skip)
        try:
            seq_id = self.scheduler.add_sequence(
                request_id, np.asarray(ids + outputs, dtype=np.int32),
                params.max_tokens - len(outputs), **self.inputs.stop_options(params),
                skip_prefix_cache=skip, key_seed=seed, schedulable=not loading)
        except Exception:
            self.tiers.forget(request_id)
            raise
        self.track(request_id, ids, params, int(seq_id), token_ids=outputs, lora_name=lora_name)
        return request_id

    def track(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              seq_id: int, token_ids: Sequence[int] = (), logprobs: Sequence[float] = (),
              index: int = 0, base_id: str = "", lora_name: str = "") -> None:
        """Register a request the scheduler already holds as `seq_id`. `token_ids` were sampled
        elsewhere (a prompt engine's first token): they count as outputs, so the request's
        next draw is at the position it would have had on a single engine. With n > 1 it is
        choice `index` (of request `base_id`, when forked), its params already the choice's."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self.requests.add(self.inputs.request(request_id, prompt_token_ids, params, seq_id,
                                              token_ids, logprobs, index, base_id, lora_name))

    def untrack(self, request_id: str) -> None:
        """Forget a request the scheduler no longer holds (freed by its role)."""
        self.requests.pop(request_id)
        self.tiers.untrack(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; its final output comes with the next
        `step()`. False when it is unknown or already finished. Every choice of an n > 1
        request ends."""
        reqs = self.requests.family(request_id)
        for req in reqs:
            self.scheduler.abort_sequence(req.request_id)
            self.tiers.forget(req.request_id)
            self._pending.append(self.output_processor.finish(req, "abort"))
        return bool(reqs)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One schedule -> run -> process_outputs round; what it produced, per request. With
        `async_scheduling`, the two-beat pipeline's round (baton/engine/pipeline.py)."""
        started, prompt_steps = time.monotonic(), self.num_prompt_steps
        if self.pipeline is not None:
            outputs = self.pipeline.step()
        else:
            outputs, self._pending = self._pending, []
            launch = self._launch(self._schedule(outputs))
            if launch is not None:
                outputs += self._book(launch, *launch.run(self.runner))
        if self.num_prompt_steps != prompt_steps:
            self.prompt_busy_s += time.monotonic() - started
        return outputs

    def _schedule(self, outputs: list[RequestOutput]):
        """The scheduler's next step (the tiers around it); the last outputs of the
        requests it dropped go to `outputs`."""
        self.tiers.land(bool(outputs))  # P10, P11: finished reads enter before the admission
        sched_out = self.scheduler.schedule()
        self.tiers.spill()  # blocks this schedule evicted, before the step rewrites them
        for request_id, reason in [*sched_out.ignored, *sched_out.finished]:
            if request_id in self.requests:
                outputs.append(self.output_processor.finish(self.requests[request_id], reason))
        return sched_out

    def _launch(self, sched_out, after: tuple[StepLaunch, np.ndarray] | None = None
                ) -> StepLaunch | None:
        """A scheduled step's runner arguments; None for an empty step. `after`: the step
        still in flight and its sampled tokens (two-beat), which fill this step's -1 input
        ids and count among the outputs its rows sample after."""
        seq_ids = np.array(sched_out.seq_ids, copy=True)
        if sched_out.prompt_run:
            self.num_prompt_steps += 1
            self.num_empty_prompt_steps += len(seq_ids) == 0
        else:
            self.num_decode_steps += 1
        if len(seq_ids) == 0:
            return None
        reqs = [self.requests.by_seq(int(s)) for s in seq_ids]
        if sched_out.prompt_run:
            self._note_cache_hits(reqs)
            seqlens_q = np.asarray(sched_out.seqlens_q)
            self.num_prompt_tokens += int(seqlens_q.sum())
            self.num_recomputed += sum(1 for r, q in zip(reqs, seqlens_q, strict=True)
                                       if len(r.token_ids) > r.num_given and q > 1)
        return self.inputs.step_launch(sched_out, seq_ids, reqs, after)

    def _book(self, launch: StepLaunch, samples, seconds: float) -> list[RequestOutput]:
        """Book a step the runner ran: tokens, stops, hand-offs, n > 1 splits, next drafts. A
        request finished or aborted while its step was in flight (two-beat) gets nothing."""
        sched_out, reqs, seqlens_q = launch.sched_out, launch.reqs, launch.seqlens_q
        if self.speculator is not None:  # the cost model's measurements (speculation.py)
            kind = ("prompt" if sched_out.prompt_run else "verify" if launch.verified
                    else "plain")
            self.speculator.costs.observe(kind, len(reqs), int(seqlens_q.sum()), seconds)
        if sched_out.prompt_run:
            self.tiers.publish(reqs, sched_out)  # P11: before the booking frees anything
        splits = plan_splits(reqs, samples, self.model_config.eos_token_ids, self.max_model_len)
        self.output_processor.add_prompt_logprobs(reqs, samples.prompt)
        result = self.scheduler.process_outputs(sched_out, samples.token_ids)
        accepted_counts = np.asarray(result.num_accepted)
        outputs = self.output_processor.book_tokens(reqs, samples, accepted_counts)
        if samples.token_ids.ndim == 2:
            self.speculator.record_step([r.request_id for r in reqs], seqlens_q,
                                        samples.token_ids)
        self.output_processor.book_ends(outputs, result, splits)
        self._propose([r for r, a in zip(reqs, accepted_counts, strict=True) if a > 0])
        return outputs

    # ------------------------------------------------------------------ speculative decoding
    def _propose(self, reqs: list[Request]) -> None:
        """Drafts for the next decode step of the requests still running here."""
        if self.speculator is None:
            return
        live = [req for req in reqs if req.request_id in self.requests]
        num_rows = min(self.scheduler.num_running(), self.config.max_num_seqs)
        for request_id, drafts in self.speculator.propose_batch(live, num_rows).items():
            self.scheduler.set_draft_tokens(request_id, drafts)

    def _note_cache_hits(self, reqs: list[Request]) -> None:
        """A request's first prompt step: what its admission took from the prefix cache."""
        for req in reqs:
            if req.num_cached_tokens is None:
                req.num_cached_tokens = int(
                    self.scheduler.num_cached_prompt_tokens(req.request_id))

    # ------------------------------------------------------------------ offline
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_names: Sequence[str] | None = None) -> list[CompletionOutput]:
        """Run prompts (str or token-id lists) to completion; outputs in prompt order.
        `lora_names[i]`: the LoRA adapter of prompt i ("" = the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        if any(sp is not None and sp.n > 1 for sp in params_list):
            raise ValueError("generate() returns one output per prompt: for n > 1 choices use "
                             "add_request() and step(), whose outputs carry each choice's index")
        loras = list(lora_names) if lora_names is not None else [""] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora_names for {len(prompts)} prompts")
        ids = [self.add_request(None, p, sp, lora_name=lora)
               for p, sp, lora in zip(prompts, params_list, loras, strict=False)]
        reqs = {rid: self.requests[rid] for rid in ids}
        while any(r.finish_reason is None for r in reqs.values()):
            self.step()
        if self.pipeline is not None:
            self.pipeline.drain()  # the finished rows' wasted step: its blocks return (S8)
        return [CompletionOutput(rid, r.prompt_token_ids, list(r.token_ids),
                                 self.tokenizer.decode(r.token_ids), r.finish_reason,
                                 list(r.logprobs) if r.params.logprobs else None,
                                 r.num_cached_tokens or 0)
                for rid, r in reqs.items()]
