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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from baton.engine.choices import choice_id, choice_params, for_choice, plan_splits
from baton.engine.config import ROLE_TYPES, EngineConfig
from baton.engine.input_processor import InputProcessor
from baton.engine.kv_disk import DiskTier, open_disk_tier
from baton.engine.kv_events import KvEventSource
from baton.engine.kv_keys import KvKeys
from baton.engine.kv_shared import SharedTier, open_shared_tier
from baton.engine.pipeline import StepLaunch, TwoBeat, fill_placeholders
from baton.engine.request import CompletionOutput, Request, RequestOutput
from baton.engine.runner_api import Runner
from baton.engine.scheduler import AllocStatus, Scheduler, SchedulerConfig, kv_window
from baton.engine.speculation import Speculator, booked_tokens, draft_masks, row_drafts
from baton.protocol import COMPLETION, NORMAL
from baton.sampling.logprobs import PromptLogprobs, TopLogprobs
from baton.sampling.params import SamplingParams
from baton.sampling.samples import PromptSpan
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
        self.scheduler = Scheduler(SchedulerConfig(
            engine_type=ROLE_TYPES[config.engine_type], num_blocks=num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_len, enable_chunked_prefill=config.enable_chunked_prefill,
            # A completion engine cannot recompute (it has no prefill path): a preempted
            # request finishes with insufficient_system_resource instead.
            stop_preempted_request=config.engine_type == COMPLETION, watermark=config.watermark,
            prefill_attempt_interval=config.prefill_attempt_interval,
            prefill_any_attempt_interval=config.prefill_any_attempt_interval,
            prefill_min_decode_steps=config.prefill_min_decode_steps,
            enable_prefix_caching=config.enable_prefix_caching,
            prefix_cache_seed=self.prefix_cache_seed,
            num_speculative_tokens=config.num_draft_tokens,
            sliding_window=kv_window(getattr(self.model_config, "layer_windows", ()))),
            all_reduce_min=all_reduce_min)
        # Drafts for the next decode step (baton/engine/speculation.py); None = plain decoding.
        self.speculator = (Speculator(config.speculative, config.num_draft_tokens,
                                      disable_by_batch_size=config.speculative_disable_by_batch_size)
                           if config.num_draft_tokens else None)
        self.max_model_len = max_len
        # --async-scheduling: steps on a forward thread, one ahead where they may (pipeline.py)
        self.pipeline = TwoBeat(self) if config.async_scheduling else None
        self._requests: dict[str, Request] = {}
        self._by_seq: dict[int, Request] = {}
        self._families: dict[str, set[str]] = {}  # n > 1: request id -> its choices' ids
        self._pending: list[RequestOutput] = []  # final outputs of aborted requests
        self._next_id = 0
        self.num_recomputed = 0  # prompt steps that re-prefilled generated tokens (preemption)
        self.num_prompt_tokens = 0  # tokens run through prefill
        self.num_generated_tokens = 0  # tokens sampled
        # Step types, so a data-parallel group can be seen to agree (S35): a rank with nothing
        # to prefill runs an empty prompt step while another prefills.
        self.num_prompt_steps = 0
        self.num_empty_prompt_steps = 0
        self.num_decode_steps = 0
        logger.info("engine: %s, model %s, %d KV blocks, max_model_len %d", config,
                    self.model_path, num_blocks, max_len)
        # The local disk tier below the pool (P10); None = off, or its directory is unusable.
        self.disk: DiskTier | None = None
        if config.kv_disk_dir:
            self.disk = open_disk_tier(config.kv_disk_dir, config.kv_disk_bytes,
                                       self.kv_fingerprint, self.kv_keys.block_bytes, self.scheduler,
                                       self.runner)
        # The shared cluster tier (P11); None = off.
        self.shared: SharedTier | None = None
        if shared_store is not None:
            if not config.enable_prefix_caching:
                raise ValueError("a shared KV tier (--kv-shared-tier) keeps prefix-cache blocks: "
                                 "it needs prefix caching on")
            self.shared = open_shared_tier(shared_store, self.kv_fingerprint,
                                           self.kv_keys.block_bytes, self.scheduler, self.runner)
        if self._tiers():
            logger.info("KV tiers: pool %d blocks x %d bytes; %s", num_blocks,
                        self.kv_keys.block_bytes, "; ".join(t.describe() for t in self._tiers()))

    def _tiers(self) -> list:
        """The tiers below the pool, in the order a prompt's blocks are looked up (P10, P11)."""
        return [t for t in (self.disk, self.shared) if t is not None]

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
        users = sum(r.lora_name == name for r in self._requests.values())
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
        if self.disk is not None and not pool_only:
            self.disk.clear()
        if self.shared is not None and shared:
            self.shared.clear()
        return True

    def close(self) -> None:
        """With a disk tier: the pool's cached blocks go to disk too, and the writer finishes,
        so that a restart (or the next role's engine, S41) finds them there (P10). With
        the two-beat pipeline, the step in flight is booked and its thread stopped first.
        The shared tier's threads stop (its blocks stay in the store, P11)."""
        if self.pipeline is not None:
            self.pipeline.close()
        if self.shared is not None:
            self.shared.close()
            self.shared = None
        if self.disk is None:
            return
        if self.scheduler.reset_prefix_cache(spill=True):
            self.disk.spill(wait=True)
        self.disk.close()
        self.disk = None

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
        """Hits, bytes and load time per KV tier (`baton_kv_tier_*`): the pool's, and the
        disk's when it is on. A block loaded from disk is hit in the pool afterwards: the
        pool's hits are those that were not loaded."""
        cache = self.scheduler.prefix_cache_stats()
        disk = self.disk.stats() if self.disk is not None else {}
        disk.update(self.shared.stats() if self.shared is not None else {})
        loaded = disk.get("kv_tier_hit_tokens_disk", 0.0) + disk.get("kv_tier_hit_tokens_shared",
                                                                      0.0)
        return {"kv_tier_hit_tokens_pool": max(0.0, cache["hit_tokens"] - loaded),
                "kv_tier_blocks_pool": float(self.scheduler.num_cached_blocks()),
                "kv_tier_bytes_pool": float(self.scheduler.num_cached_blocks()
                                            * self.kv_keys.block_bytes),
                "kv_tier_capacity_bytes_pool": float(self.scheduler.num_total_blocks()
                                                     * self.kv_keys.block_bytes),
                "kv_tier_capacity_tokens_pool": float(self.scheduler.num_total_blocks()
                                                      * self.config.block_size),
                **disk}

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
        for tier in self._tiers() if len(block_keys) else ():  # P10, P11: loaded, not pulled
            tier.load_now(prompt_token_ids + output_token_ids,
                          self.kv_keys.block_seed(seed))
        alloc = self.scheduler.allocate_prompted(
            request_id, prompt_token_ids + output_token_ids, first_token,
            params.max_tokens - len(output_token_ids), **self.inputs.stop_options(params),
            block_keys=block_keys if self.config.enable_prefix_caching else (),
            key_seed=seed)
        if self.disk is not None:
            self.disk.spill()  # the allocation may have evicted: out before the pull lands
        if alloc.status == AllocStatus.OK:
            self.track(request_id, prompt_token_ids, for_choice(params, params.sample_index, index),
                       alloc.seq_id, token_ids=[*output_token_ids, first_token],
                       logprobs=[first_logprob], index=index)
            self._requests[request_id].lora_name = lora_name
        return alloc

    def commit_prompted(self, request_id: str,
                        choices: Sequence[tuple[int, int, float]] = ()) -> None:
        """Its KV landed: it decodes from the next step; with n > 1 its other choices (index,
        first token, logprob) fork from it and share the blocks just pulled (S16)."""
        self.scheduler.commit_prompted(request_id)
        if choices:
            self._fork_choices(request_id, choices)
        self._propose([self._requests[request_id]])

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
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        ids = self.inputs.check_prompt(request_id, prompt)
        outputs = self.inputs.check_outputs(request_id, output_token_ids, params)
        if params.n > 1 and outputs:
            raise ValueError(f"request {request_id!r}: n={params.n} with earlier outputs (a "
                             "migrated request) is not supported")
        self.inputs.check_grammar(params, outputs)
        # Prompt logprobs need the logits of every prompt position: a cached prefix has none.
        seed = self.request_key_seed(request_id, cache_salt, lora_name)
        skip = params.prompt_logprobs >= 0
        # P10, P11: blocks of it on disk (else in the shared tier) are read first; it waits
        # (S15) until they are in the pool.
        loading = self._plan_tiers(request_id, ids + outputs,
                                   self.kv_keys.block_seed(seed), skip)
        try:
            seq_id = self.scheduler.add_sequence(
                request_id, np.asarray(ids + outputs, dtype=np.int32),
                params.max_tokens - len(outputs), **self.inputs.stop_options(params),
                skip_prefix_cache=skip, key_seed=seed, schedulable=not loading)
        except Exception:
            for tier in self._tiers():
                tier.forget(request_id)
            raise
        self.track(request_id, ids, params, int(seq_id), token_ids=outputs)
        self._requests[request_id].lora_name = lora_name
        return request_id

    def _plan_tiers(self, request_id: str, token_ids: list[int], seed: int, skip: bool) -> bool:
        if self.shared is not None:
            self.shared.remember(request_id, seed)  # what it computes is published (P11)
        return not skip and any(t.plan(request_id, token_ids, seed) for t in self._tiers())

    def track(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
              seq_id: int, token_ids: Sequence[int] = (), logprobs: Sequence[float] = (),
              index: int = 0, base_id: str = "") -> None:
        """Register a request the scheduler already holds as `seq_id`. `token_ids` were sampled
        elsewhere (a prompt engine's first token): they count as outputs, so the request's
        next draw is at the position it would have had on a single engine. With n > 1 it is
        choice `index` (of request `base_id`, when forked), its params already the choice's."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        req = Request(request_id, prompt_token_ids, params, seq_id=seq_id,
                       num_given=len(token_ids), index=index, base_id=base_id,
                       base_sample_index=params.sample_index - index,
                       is_split=params.n == 1 or bool(token_ids))
        if params.n > 1:
            self._families.setdefault(req.wire_id, set()).add(request_id)
        req.token_ids.extend(int(t) for t in token_ids)
        if params.logprobs:
            req.logprobs.extend(float(lp) for lp in logprobs)
        if params.prompt_logprobs >= 0:
            req.prompt_logprobs = PromptLogprobs()
        if params.grammar:  # checked by check_grammar: compiled, and takes token_ids
            req.matcher = self.inputs.grammars.matcher(params.grammar)
            req.matcher.consume_tokens([int(t) for t in token_ids])
        self._requests[request_id] = req
        self._by_seq[seq_id] = req

    def untrack(self, request_id: str) -> None:
        """Forget a request the scheduler no longer holds (freed by its role)."""
        req = self._requests.pop(request_id, None)
        if self.shared is not None:
            self.shared.forget(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)
        if req is not None:
            self._by_seq.pop(req.seq_id, None)
            family = self._families.get(req.wire_id)
            if family is not None:
                family.discard(request_id)
                if not family:
                    del self._families[req.wire_id]

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; its final output comes with the next
        `step()`. False when it is unknown or already finished. Every choice of an n > 1
        request ends."""
        ids = sorted(self._families.get(request_id, ())) or [request_id]
        reqs = [self._requests[i] for i in ids if i in self._requests]
        for req in reqs:
            self.scheduler.abort_sequence(req.request_id)
            for tier in self._tiers():
                tier.forget(req.request_id)
            self._pending.append(self._finish(req, "abort"))
        return bool(reqs)

    def _finish(self, req: Request, reason: str) -> RequestOutput:
        req.finish_reason = reason
        self.untrack(req.request_id)
        return RequestOutput(req.request_id, [], [] if req.params.logprobs else None, True,
                             reason, index=req.index, base_id=req.base_id)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One schedule -> run -> process_outputs round; what it produced, per request. With
        `async_scheduling`, the two-beat pipeline's round (baton/engine/pipeline.py)."""
        if self.pipeline is not None:
            return self.pipeline.step()
        outputs, self._pending = self._pending, []
        launch = self._launch(self._schedule(outputs))
        if launch is not None:
            outputs += self._book(launch, *launch.run(self.runner))
        return outputs

    def _schedule(self, outputs: list[RequestOutput]):
        """The scheduler's next step (the tiers around it); the last outputs of the
        requests it dropped go to `outputs`."""
        if self._tiers():  # P10, P11: finished reads enter the pool before the admission
            num_loading = sum(t.num_pending for t in self._tiers())
            idle = (self.scheduler.num_running() == 0 and not outputs
                    and self.scheduler.num_waiting() <= num_loading)
            for tier in self._tiers():
                tier.land(wait_s=0.002 if idle else 0.0)
        sched_out = self.scheduler.schedule()
        if self.disk is not None:
            self.disk.spill()  # blocks this schedule evicted, before the step rewrites them
        for request_id, reason in [*sched_out.ignored, *sched_out.finished]:
            if request_id in self._requests:
                outputs.append(self._finish(self._requests[request_id], reason))
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
        reqs = [self._by_seq[int(s)] for s in seq_ids]
        seqlens_q, seqlens_k = np.asarray(sched_out.seqlens_q), np.asarray(sched_out.seqlens_k)
        if sched_out.prompt_run:
            self._note_cache_hits(reqs)
            self.num_prompt_tokens += int(seqlens_q.sum())
            self.num_recomputed += sum(1 for r, q in zip(reqs, seqlens_q, strict=True)
                                       if len(r.token_ids) > r.num_given and q > 1)
        run_out, so_far = sched_out, [r.token_ids for r in reqs]
        if after is not None:  # the outputs a row samples after: its booked ones and N's token
            run_out, filled = fill_placeholders(sched_out, seq_ids, *after)
            so_far = [[*r.token_ids, filled[int(s)]] if int(s) in filled else list(r.token_ids)
                      for r, s in zip(reqs, seq_ids, strict=True)]
        # Only a row whose context is complete is sampled: a non-final prompt chunk is not. A
        # decode row's context runs past the request's tokens by its drafts (q - 1).
        drafted = 0 if sched_out.prompt_run else seqlens_q - 1
        complete = [int(k) == len(r.prompt_token_ids) + len(t)
                    for r, t, k in zip(reqs, so_far, seqlens_k - drafted, strict=True)]
        spans = (self._prompt_spans(reqs, seqlens_q, seqlens_k) if sched_out.prompt_run
                 else None)
        verified = not sched_out.prompt_run and int(seqlens_q.max()) > 1
        args = (run_out, seq_ids,
                [r.params if c else None for r, c in zip(reqs, complete, strict=True)],
                [r.prompt_token_ids for r in reqs], so_far, spans,
                self._allowed_tokens(reqs, complete, row_drafts(sched_out) if verified else None),
                choice_params(reqs, complete))
        kwargs = ({"lora_names": [r.lora_name for r in reqs]}
                  if any(r.lora_name for r in reqs) else {})
        return StepLaunch(sched_out, seq_ids, reqs, seqlens_q, verified, args, kwargs)

    def _book(self, launch: StepLaunch, samples, seconds: float) -> list[RequestOutput]:
        """Book a step the runner ran: tokens, stops, hand-offs, n > 1 splits, next drafts. A
        request finished or aborted while its step was in flight (two-beat) gets nothing."""
        sched_out, reqs, seqlens_q = launch.sched_out, launch.reqs, launch.seqlens_q
        outputs: list[RequestOutput] = []
        if self.speculator is not None:  # the cost model's measurements (speculation.py)
            kind = ("prompt" if sched_out.prompt_run else "verify" if launch.verified
                    else "plain")
            self.speculator.costs.observe(kind, len(reqs), int(seqlens_q.sum()), seconds)
        if self.shared is not None and sched_out.prompt_run:
            self.shared.publish(reqs, sched_out)  # P11: before the booking frees anything
        splits = plan_splits(reqs, samples, self.model_config.eos_token_ids, self.max_model_len)
        for req, prompt in zip(reqs, samples.prompt, strict=True):
            if prompt is not None:
                req.prompt_logprobs.logprobs.extend(prompt.logprobs)
                req.prompt_logprobs.top.extend(prompt.top)
        result = self.scheduler.process_outputs(sched_out, samples.token_ids)
        accepted_counts = np.asarray(result.num_accepted)
        for i, (req, accepted) in enumerate(zip(reqs, accepted_counts, strict=True)):
            if accepted > 0 and self._requests.get(req.request_id) is req:
                tokens, logprobs = booked_tokens(samples, i, int(accepted))
                outputs.append(self._append(req, tokens, logprobs, samples.top[i]))
                if req.matcher is not None:
                    self._advance_matcher(req, outputs[-1])
        if samples.token_ids.ndim == 2:
            self.speculator.record_step([r.request_id for r in reqs], seqlens_q,
                                        samples.token_ids)
        self._hand_off(outputs, result.handed_off)
        self._book_finished(outputs, dict(result.finished))
        for req, split, top in splits:
            self._split(req, split, top, outputs)
        self._propose([r for r, a in zip(reqs, accepted_counts, strict=True) if a > 0])
        return outputs

    # ------------------------------------------------------------------ speculative decoding
    def _propose(self, reqs: list[Request]) -> None:
        """Drafts for the next decode step of the requests still running here."""
        if self.speculator is None:
            return
        live = [req for req in reqs if req.request_id in self._requests]
        num_rows = min(self.scheduler.num_running(), self.config.max_num_seqs)
        for request_id, drafts in self.speculator.propose_batch(live, num_rows).items():
            self.scheduler.set_draft_tokens(request_id, drafts)

    def _allowed_tokens(self, reqs: list[Request], complete: list[bool],
                        drafts: list[list[int]] | None = None) -> list | None:
        """Each sampled structured row's grammar mask (bool [vocab]; [1 + k, vocab] for a row
        verifying k drafts: the mask at each of its positions); None when none."""
        if all(r.matcher is None for r in reqs):
            return None
        grammars = self.inputs.grammars
        return [None if r.matcher is None or not c else
                draft_masks(grammars, r.matcher, drafts[i]) if drafts and drafts[i] else
                grammars.allowed_tokens(r.matcher)
                for i, (r, c) in enumerate(zip(reqs, complete, strict=True))]

    def _advance_matcher(self, req: Request, out: RequestOutput) -> None:
        """Feed the matcher its row's tokens (kept drafts too); one it refuses (cannot happen
        under its own masks) finishes the request."""
        refused = next((t for t in out.new_token_ids if not req.matcher.consume_token(t)), None)
        if refused is None:
            return
        logger.warning("request %s: grammar refused token %d: %s", req.request_id,
                       refused, req.matcher.get_error())
        self.scheduler.abort_sequence(req.request_id)
        self._finish(req, "structured_output_failed")
        out.finished, out.finish_reason = True, "structured_output_failed"

    # ------------------------------------------------------------------ n > 1 (baton/engine/choices.py)
    def _split(self, req: Request, split, top: TopLogprobs | None,
               outputs: list[RequestOutput]) -> None:
        """After booking: the other choices' first tokens; NORMAL forks those that go on, a
        PROMPT engine hands them off with the carrier (its worker names them in the hand-off)."""
        forks = self.config.engine_type == NORMAL and req.request_id in self._requests
        for j in split.others():
            token, lp, reason = split.token_ids[j], split.logprobs[j], split.reasons[j]
            if forks and not reason:
                child = self._fork(req, j, token, lp)
                rid = child.request_id
            else:
                rid = choice_id(req.wire_id, j)
                if not reason and self.config.engine_type == NORMAL:
                    reason = req.finish_reason or "abort"  # the carrier failed: no fork
            self.num_generated_tokens += 1
            outputs.append(RequestOutput(rid, [token], [lp] if req.params.logprobs else None,
                                         bool(reason), reason or None, top=top, index=j,
                                         base_id=req.wire_id))

    def _fork_choices(self, request_id: str,
                      choices: Sequence[tuple[int, int, float]]) -> None:
        req = self._requests[request_id]
        for index, token, lp in choices:
            self._fork(req, index, token, lp)

    def _fork(self, req: Request, index: int, token: int, logprob: float) -> Request:
        cid = choice_id(req.wire_id, index)
        seq_id = self.scheduler.fork_seq(req.request_id, cid, "n", last_token_id=token)
        self.track(cid, req.prompt_token_ids, for_choice(req.params, req.base_sample_index, index),
                   int(seq_id), token_ids=[token], logprobs=[logprob], index=index,
                   base_id=req.wire_id)
        child = self._requests[cid]
        child.num_cached_tokens = req.num_cached_tokens
        child.lora_name = req.lora_name
        child.prompt_logprobs = None  # the prompt was scored once, for the carrier
        return child

    @staticmethod
    def _prompt_spans(reqs: list[Request], seqlens_q: np.ndarray,
                      seqlens_k: np.ndarray) -> list[PromptSpan | None] | None:
        """Prompt steps of requests asking prompt logprobs: which chunk positions predict the
        prompt tokens not scored yet (a recomputed prompt was scored the first time)."""
        spans: list[PromptSpan | None] = []
        for req, q, k in zip(reqs, seqlens_q, seqlens_k, strict=True):
            scored = req.prompt_logprobs
            start, num_prompt = int(k) - int(q), len(req.prompt_token_ids)
            end = min(int(k), num_prompt - 1)  # the last prompt position predicts an output
            if scored is None or len(scored.logprobs) >= end:
                spans.append(None)
                continue
            have = len(scored.logprobs)
            # The prompt skipped the prefix cache, so every position not scored is computed.
            assert start <= have, (req.request_id, start, have)
            spans.append(PromptSpan(have - start, req.prompt_token_ids[have + 1:end + 1],
                                    req.params.prompt_logprobs))
        return spans if any(s is not None for s in spans) else None

    def _note_cache_hits(self, reqs: list[Request]) -> None:
        """A request's first prompt step: what its admission took from the prefix cache."""
        for req in reqs:
            if req.num_cached_tokens is None:
                req.num_cached_tokens = int(
                    self.scheduler.num_cached_prompt_tokens(req.request_id))

    def _hand_off(self, outputs: list[RequestOutput], handed_off) -> None:
        """PROMPT mode: prompts that left the scheduler with their blocks leave the engine too;
        their output names the blocks, for the prompt role to hold under a lease."""
        by_id = {out.request_id: out for out in outputs}
        for request_id, block_ids in handed_off:
            req = self._requests[request_id]
            self.untrack(request_id)
            out = by_id[request_id]
            out.handed_off_block_ids = [int(b) for b in block_ids]
            # The tokens whose K/V leaves: a migrated request's earlier outputs too.
            out.num_prompt_tokens = len(req.prompt_token_ids) + req.num_given

    def _book_finished(self, outputs: list[RequestOutput], finished: dict[str, str]) -> None:
        for out in outputs:
            reason = finished.pop(out.request_id, None)
            if reason is not None and out.request_id in self._requests:
                self._finish(self._requests[out.request_id], reason)
                out.finished, out.finish_reason = True, reason
        for request_id, reason in finished.items():  # finished without a token this step
            if request_id in self._requests:
                outputs.append(self._finish(self._requests[request_id], reason))

    def _append(self, req: Request, tokens: list[int], logprobs: list[float],
                top: TopLogprobs | None = None) -> RequestOutput:
        """A step's tokens of one request (several when drafts were kept)."""
        self.num_generated_tokens += len(tokens)
        first = len(req.token_ids) == req.num_given
        req.token_ids.extend(tokens)
        if req.params.logprobs:
            req.logprobs.extend(logprobs)
        if top is not None and len(top.token_ids) > len(tokens):  # a stop among kept drafts
            top = TopLogprobs(top.token_ids[:len(tokens)], top.logprobs[:len(tokens)])
        out = RequestOutput(req.request_id, tokens, logprobs if req.params.logprobs else None,
                            top=top, index=req.index, base_id=req.base_id)
        if first:
            out.num_cached_tokens = req.num_cached_tokens or 0
            if not req.num_given:  # scored here: the prompt was prefilled on this engine
                out.prompt = req.prompt_logprobs
        return out

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
        reqs = {rid: self._requests[rid] for rid in ids}
        while any(r.finish_reason is None for r in reqs.values()):
            self.step()
        if self.pipeline is not None:
            self.pipeline.drain()  # the finished rows' wasted step: its blocks return (S8)
        return [CompletionOutput(rid, r.prompt_token_ids, list(r.token_ids),
                                 self.tokenizer.decode(r.token_ids), r.finish_reason,
                                 list(r.logprobs) if r.params.logprobs else None,
                                 r.num_cached_tokens or 0)
                for rid, r in reqs.items()]
