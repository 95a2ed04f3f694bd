"""An engine on the wire: `EngineWorker` serves an `LLMEngine` to the service loop.

The base every role extends (`normal_engine/`, `prompt_engine/`, `completion_engine/`): wire
options -> `SamplingParams`, the engine's `RequestOutput`s -> `TokenDelta`s, aborts, stats, the
registry record and the KV event source. A role adds its own part of a request's life.
"""

from __future__ import annotations

import logging

from baton.engine import LLMEngine, RequestOutput
from baton.engine.kv_events import KvEventSource
from baton.engine.kv_identity import weights_digest  # noqa: F401 (its old home, for importers)
from baton.ops.registry import EngineRecord
from baton.protocol import EngineStats, GenerateRequest, SamplingOptions, TokenDelta
from baton.sampling.params import SamplingParams
from kv_transfer.protocol import Fingerprint

logger = logging.getLogger(__name__)


def to_sampling_params(opts: SamplingOptions) -> SamplingParams:
    """Wire options -> engine params; ValueError (with the bad value) on nonsense."""
    return SamplingParams(
        temperature=float(opts.temperature), top_k=int(opts.top_k), top_p=float(opts.top_p),
        seed=opts.seed, max_tokens=int(opts.max_tokens),
        stop_token_ids=tuple(int(t) for t in opts.stop_token_ids),
        ignore_eos=bool(opts.ignore_eos), logprobs=bool(opts.logprobs),
        presence_penalty=opts.presence_penalty, frequency_penalty=opts.frequency_penalty,
        repetition_penalty=opts.repetition_penalty, logit_bias=dict(opts.logit_bias),
        min_tokens=opts.min_tokens, min_p=opts.min_p, sample_index=opts.sample_index,
        top_logprobs=int(opts.top_logprobs), prompt_logprobs=int(opts.prompt_logprobs),
        grammar=str(opts.grammar), n=int(opts.n),
        speculative=bool(opts.speculative))


def to_delta(out: RequestOutput) -> TokenDelta:
    delta = TokenDelta(out.request_id, list(out.new_token_ids), list(out.new_logprobs or []),
                       (out.finish_reason or "") if out.finished else "",
                       num_prompt_tokens=out.num_prompt_tokens,
                       num_cached_tokens=out.num_cached_tokens)
    if out.top is not None:
        delta.top_token_ids, delta.top_logprobs = out.top.token_ids, out.top.logprobs
    if out.index:
        delta.index = out.index
    if out.base_id:  # a choice forked from the request (n > 1): the router knows one id
        delta.req_id = out.base_id
    if out.prompt is not None:
        delta.prompt_logprobs = out.prompt.logprobs
        delta.prompt_top_token_ids = out.prompt.top_token_ids
        delta.prompt_top_logprobs = out.prompt.top_logprobs
    return delta


def error_delta(req_id: str, message: str, reason: str = "error") -> TokenDelta:
    return TokenDelta(req_id, finish_reason=reason, error=message)


class EngineWorker:
    """An `LLMEngine` behind the service loop; each role (a subclass) names itself in `role`."""

    role = ""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    @property
    def model_fingerprint(self) -> str:
        """Model and KV layout identity, published in the registry."""
        return self.engine.model_fingerprint

    def kv_fingerprint(self) -> Fingerprint:
        """What two engines must share to exchange KV blocks byte for byte (kv_transfer)."""
        return self.engine.kv_fingerprint

    def add_request(self, req: GenerateRequest) -> list[TokenDelta]:
        try:
            params = to_sampling_params(req.sampling)
            self.engine.add_request(req.req_id, req.prompt_token_ids, params,
                                    req.output_token_ids, cache_salt=req.cache_salt,
                                    lora_name=req.lora_name)
        except ValueError as exc:
            return [error_delta(req.req_id, str(exc))]
        return []

    def abort_request(self, req_id: str) -> list[TokenDelta]:
        self.engine.abort_request(req_id)
        return []  # the final delta (reason abort) comes with the next step

    def step(self) -> list[TokenDelta]:
        return [to_delta(out) for out in self.engine.step()]

    def tick(self) -> list[TokenDelta]:
        return []

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def has_pending(self) -> bool:
        return False

    def fill_stats(self, stats: EngineStats) -> None:
        engine, counts = self.engine, self.engine.stats()
        stats.num_free_blocks = int(counts["num_free_blocks"])
        stats.num_total_blocks = int(counts["num_total_blocks"])
        stats.num_running = int(counts["num_running"])
        stats.num_waiting = int(counts["num_waiting"])
        stats.num_prompt_tokens = engine.num_prompt_tokens
        stats.num_generated_tokens = engine.num_generated_tokens
        stats.extra["num_prompt_steps"] = float(engine.num_prompt_steps)
        stats.extra["num_empty_prompt_steps"] = float(engine.num_empty_prompt_steps)
        stats.extra["num_decode_steps"] = float(engine.num_decode_steps)
        stats.extra["prompt_busy_s"] = engine.prompt_busy_s
        stats.extra["num_recomputed"] = float(engine.num_recomputed)
        for key in ("num_preemptions", "num_handed_off", "prefix_cache_query_tokens",
                    "prefix_cache_hit_tokens", "num_cached_blocks"):
            stats.extra[key] = float(counts[key])
        if engine.speculator is not None:
            stats.extra.update(engine.speculator.metrics())
        stats.lora_adapters = engine.lora_adapters()
        stats.extra.update(engine.tier_stats())

    def fill_record(self, record: EngineRecord) -> None:
        counts = self.engine.stats()
        record.model_fingerprint = self.model_fingerprint
        record.block_size = self.engine.config.block_size
        for key in ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting"):
            setattr(record, key, int(counts[key]))
        record.lora_adapters = self.engine.lora_adapters()

    def reset_prefix_cache(self, pool_only: bool = False, shared: bool = False) -> bool:
        return self.engine.reset_prefix_cache(pool_only, shared)

    def load_lora(self, name: str, path: str) -> str:
        """ValueError naming the adapter when it does not load."""
        return self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def kv_event_source(self) -> KvEventSource:
        """The prefix cache's keys for cache-aware routing (baton/engine/kv_events.py)."""
        return self.engine.kv_event_source()

    def close(self) -> None:
        self.engine.close()
