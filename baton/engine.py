"""The single-rank engine: scheduler (NORMAL mode) + paged model + sampler in one step loop.

A request's life in the engine:
1. `add_request` tokenizes the prompt (str, or token ids as given) and queues it in the
   scheduler's `waiting` queue; nothing is allocated yet.
2. `step()`: `schedule()` picks a batch (a prompt step, possibly one chunk of a long prompt, or a
   decode step over `running`) and allocates blocks; the model runs the flat batch, writing K/V
   into the pool; rows whose prompt is complete are sampled; `process_outputs` appends the tokens.
3. When the pool runs out, the scheduler preempts the youngest sequence and puts it back in
   `waiting`; it is later prefilled again from prompt + tokens so far (recompute). Its seeded
   generator is untouched by that, so its output does not change.
4. EOS / stop token / max_tokens finish it (`process_outputs().finished`); `abort_request` finishes
   it at once. Either way its blocks go back to the pool and the last delta says why.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from baton.model import IncrementalDetokenizer, KVCacheSpec, allocate_kv_cache, load_model
from baton.model.config import resolve_dtype
from baton.model.loader import LoadedModel
from baton.sampler import Sampler, SamplingParams
from baton.scheduler import EngineType, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    """Model, cache and batching of one engine."""

    model: str | None = None  # GGUF file or HF folder; None = SmolLM2-135M-Instruct
    dtype: str = "float32"  # float32 | bfloat16 | float16
    device: str | None = None  # None = cuda when present, else cpu
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV blocks incl. the null block; 0 = fill kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 512 * 2**20  # budget used when num_blocks == 0
    max_num_seqs: int = 64  # sequences in one decode batch
    max_num_batched_tokens: int = 2048  # tokens in one prompt step (chunk size)
    max_model_len: int = 0  # prompt + output; 0 = the model's context (capped by the pool)
    enable_chunked_prefill: bool = True
    # A single rank has no peers to agree with, and every decode step it delays a waiting
    # prompt is pure queueing latency, so it attempts a prefill at every step (the scheduler's
    # default of 70 is for data-parallel ranks voting to prefill together).
    prefill_attempt_interval: int = 1
    prefill_any_attempt_interval: int = 1
    watermark: float = 0.9  # prefill only at or below this cache usage
    num_threads: int = 2  # torch intra-op threads; 0 = leave torch's default (all cores)

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens",
                     "prefill_attempt_interval", "prefill_any_attempt_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_blocks", "kv_cache_memory_bytes", "max_model_len", "num_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.num_blocks == 1:
            raise ValueError("EngineConfig.num_blocks must be 0 (auto) or >= 2, got 1")


@dataclass
class RequestOutput:
    """What one step produced for one request (a delta); `finished` on its last one."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | prompt_length_exceeded | ...


@dataclass
class CompletionOutput:
    """A finished request (offline `generate`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    seq_id: int = -1  # the scheduler's stable integer id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.token_ids)


class LLMEngine:
    """Offline `generate`, and `add_request` / `step` / `abort_request` for a service loop."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 ) -> None:
        """`loaded` reuses an already loaded model (tests, benchmarks); it must match `config`."""
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        loaded = loaded or load_model(config.model, dtype=config.dtype, device=config.device)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_path = loaded.path
        self.kv_spec = KVCacheSpec.from_model(self.model_config, config.block_size)
        num_blocks = config.num_blocks or self.kv_spec.num_blocks_for_budget(
            config.kv_cache_memory_bytes)
        self.kv_cache = allocate_kv_cache(self.kv_spec, num_blocks, self.model.device)
        # Never longer than the pool holds: such a prompt is refused at once, not left waiting.
        max_len = min(config.max_model_len or self.model_config.max_position,
                      self.model_config.max_position, (num_blocks - 1) * config.block_size)
        self.scheduler = Scheduler(SchedulerConfig(
            engine_type=EngineType.NORMAL, num_blocks=num_blocks, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_len, enable_chunked_prefill=config.enable_chunked_prefill,
            stop_preempted_request=False, watermark=config.watermark,
            prefill_attempt_interval=config.prefill_attempt_interval,
            prefill_any_attempt_interval=config.prefill_any_attempt_interval))
        self.max_model_len = max_len
        self.sampler = Sampler()
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._pending: list[RequestOutput] = []  # final deltas of aborted requests
        self._next_id = 0
        self.num_recomputed = 0  # prompt steps that re-prefilled generated tokens (preemption)
        logger.info("engine: %s, model %s, %d KV blocks, max_model_len %d", config,
                    self.model_path, num_blocks, max_len)

    @classmethod
    def from_config(cls, **kwargs) -> LLMEngine:
        """`LLMEngine.from_config(model=..., dtype=..., num_blocks=...)`: EngineConfig fields."""
        return cls(EngineConfig(**kwargs))

    # ------------------------------------------------------------------ counters
    def num_free_blocks(self) -> int:
        return self.scheduler.num_free_blocks()

    def num_total_blocks(self) -> int:
        return self.scheduler.num_total_blocks()

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None) -> str:
        """Queue a prompt (text is tokenized as is: apply a chat template first if wanted).
        Returns the request id (generated when None); ValueError on a duplicate or empty one."""
        params = params or SamplingParams()
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"request {request_id!r}: empty prompt")
        if max(ids) >= self.model_config.vocab_size or min(ids) < 0:
            raise ValueError(f"request {request_id!r}: token id out of range "
                             f"[0, {self.model_config.vocab_size})")
        req = _Request(request_id, ids, params, params.make_generator(self.model.device),
                       IncrementalDetokenizer(self.tokenizer))
        seq_id = self.scheduler.add_sequence(
            request_id, np.asarray(ids, dtype=np.int32), params.max_tokens,
            eos_token_ids=self.model_config.eos_token_ids, stop_token_ids=params.stop_token_ids,
            ignore_eos=params.ignore_eos)
        req.seq_id = int(seq_id)
        self._requests[request_id] = req
        self._by_seq[req.seq_id] = req
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now and free its blocks; its final delta comes with the next
        `step()`. False when it is unknown or already finished."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self.scheduler.abort_sequence(request_id)
        self._pending.append(self._finish(req, "abort"))
        return True

    def _finish(self, req: _Request, reason: str) -> RequestOutput:
        req.finish_reason = reason
        self._requests.pop(req.request_id, None)
        self._by_seq.pop(req.seq_id, None)
        return RequestOutput(req.request_id, [], req.detok.flush(),
                             [] if req.params.logprobs else None, True, reason)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One schedule -> forward -> sample -> process_outputs round; the deltas it produced."""
        outputs, self._pending = self._pending, []
        sched_out = self.scheduler.schedule()
        for request_id, reason in [*sched_out.ignored, *sched_out.finished]:
            if request_id in self._requests:
                outputs.append(self._finish(self._requests[request_id], reason))
        seq_ids = np.array(sched_out.seq_ids, copy=True)
        if len(seq_ids) == 0:
            return outputs
        reqs = [self._by_seq[int(s)] for s in seq_ids]
        logits = self.model(sched_out.input_ids, sched_out.positions, sched_out.slot_mapping,
                            sched_out.seqlens_q, sched_out.seqlens_k, sched_out.block_tables,
                            self.kv_cache)
        if sched_out.prompt_run:
            self.num_recomputed += sum(1 for r, q in zip(reqs, np.asarray(sched_out.seqlens_q), strict=False)
                                       if r.token_ids and q > 1)
        sampled, logprobs = self._sample(reqs, logits, np.asarray(sched_out.seqlens_k))
        result = self.scheduler.process_outputs(sched_out, sampled)
        for req, accepted, token, logprob in zip(reqs, np.asarray(result.num_accepted),
                                                 sampled, logprobs, strict=False):
            if accepted > 0:
                outputs.append(self._append(req, int(token), float(logprob)))
        finished = dict(result.finished)
        for out in outputs:
            reason = finished.pop(out.request_id, None)
            if reason is not None and out.request_id in self._requests:
                final = self._finish(self._requests[out.request_id], reason)
                out.new_text += final.new_text
                out.finished, out.finish_reason = True, reason
        for request_id, reason in finished.items():  # finished without a token this step
            if request_id in self._requests:
                outputs.append(self._finish(self._requests[request_id], reason))
        return outputs

    def _sample(self, reqs: list[_Request], logits: torch.Tensor,
                seqlens_k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sample the rows whose context is complete; a non-final prompt chunk gets a dummy 0
        (the scheduler ignores it) and does not advance its generator."""
        n = len(reqs)
        sampled = np.zeros(n, dtype=np.int32)
        logprobs = np.zeros(n, dtype=np.float32)
        rows = [i for i, r in enumerate(reqs) if int(seqlens_k[i]) == r.num_tokens]
        if rows:
            ids, lps = self.sampler(logits[rows], [reqs[i].params for i in rows],
                                    [reqs[i].generator for i in rows])
            sampled[rows] = ids.cpu().numpy()
            logprobs[rows] = lps.cpu().numpy()
        return sampled, logprobs

    def _append(self, req: _Request, token: int, logprob: float) -> RequestOutput:
        req.token_ids.append(token)
        if req.params.logprobs:
            req.logprobs.append(logprob)
        return RequestOutput(req.request_id, [token], req.detok.add(token),
                             [logprob] if req.params.logprobs else None)

    # ------------------------------------------------------------------ offline
    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[CompletionOutput]:
        """Run prompts (str or token-id lists) to completion; outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(prompts)} prompts")
        ids = [self.add_request(None, p, sp) for p, sp in zip(prompts, params_list, strict=False)]
        reqs = {rid: self._requests[rid] for rid in ids}
        while any(r.finish_reason is None for r in reqs.values()):
            self.step()
        return [CompletionOutput(rid, r.prompt_token_ids, list(r.token_ids),
                                 self.tokenizer.decode(r.token_ids), r.finish_reason,
                                 list(r.logprobs) if r.params.logprobs else None)
                for rid, r in reqs.items()]
