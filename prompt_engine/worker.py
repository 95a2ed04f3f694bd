"""The PROMPT role: prefill only, then hand the prompt's KV to a completion engine.

A request's life in this process:
1. `GenerateRequest` (no KV handle) -> `LLMEngine.add_request` -> scheduler `waiting`
   (PROMPT mode: every step is a prompt step; long prompts are chunked as the scheduler says).
2. The step that completes the prompt samples the first token. If that already finishes the
   request (EOS, max_tokens 1) its blocks are freed and the delta carries the finish reason.
3. Otherwise the scheduler hands the sequence off with its blocks; `HandOff` (handoff.py) holds
   them under a lease keyed by request id and the delta carries the first token and the encoded
   `KVHandle` for the router to pass to a completion engine. With n > 1 (baton/engine/choices.py) the
   step sends one delta per choice, each with its own first token, the handle on the last.
4. The lease ends (pulled and released, expired, or aborted); `tick()` returns the blocks, which
   stay in the prefix cache (keyed), so the next turn of the conversation skips their prefill.
"""

from __future__ import annotations

import logging

from baton.engine import LLMEngine
from baton.ops.registry import EngineRecord
from baton.protocol import PROMPT, EngineStats, GenerateRequest, TokenDelta
from baton.service.worker import EngineWorker, error_delta, to_delta
from kv_transfer.config import TransferConfig
from kv_transfer.integrity import FaultPlan
from prompt_engine.handoff import HandOff

logger = logging.getLogger(__name__)


class PromptWorker(EngineWorker):
    role = PROMPT

    def __init__(self, engine: LLMEngine, transfer: TransferConfig, engine_id: str,
                 advertise_host: str = "", faults: FaultPlan | None = None):
        super().__init__(engine)
        self.handoff = HandOff(engine.kv_cache, transfer, self.kv_fingerprint(), engine_id,
                               advertise_host, faults)

    @property
    def side_channel(self) -> str:
        return self.handoff.side_channel

    def add_request(self, req: GenerateRequest) -> list[TokenDelta]:
        if req.kv_handle:
            return [error_delta(req.req_id, "a prompt engine takes no KV handle")]
        return super().add_request(req)

    def abort_request(self, req_id: str) -> list[TokenDelta]:
        if self.engine.abort_request(req_id):
            return []  # still prefilling: the final delta comes with the next step
        if self.handoff.abort(req_id):  # handed off, lease not claimed yet
            return [TokenDelta(req_id, finish_reason="abort")]
        return []  # unknown, finished, or claimed (freed once its reader is done)

    def step(self) -> list[TokenDelta]:
        outputs = self.engine.step()
        deltas = [to_delta(out) for out in outputs]
        for out in outputs:
            if out.handed_off_block_ids is not None:
                # The keys name the blocks' contents whether or not this engine caches: a
                # completion engine that does can reuse what it holds.
                handle = self.handoff.hold(out.request_id, out.handed_off_block_ids,
                                           out.num_prompt_tokens,
                                           self.engine.block_keys(out.request_id))
                # On the request's last delta: with n > 1 the other choices' first tokens come
                # before it, and the handle ends the request here.
                last = max(i for i, d in enumerate(deltas) if d.req_id == out.request_id)
                deltas[last].kv_handle = handle
        return deltas

    def tick(self) -> list[TokenDelta]:
        self.handoff.release_ended(self.engine.release_handed_off)
        return []

    def fill_stats(self, stats: EngineStats) -> None:
        super().fill_stats(stats)
        for key, value in self.handoff.metrics().items():
            if isinstance(value, (int, float)):
                stats.extra[f"kv_{key}"] = float(value)

    def fill_record(self, record: EngineRecord) -> None:
        super().fill_record(record)
        record.side_channel = self.handoff.side_channel

    def close(self) -> None:
        self.handoff.close()
        super().close()
