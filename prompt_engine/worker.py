"""The PROMPT role: prefill only, then hand the prompt's KV to a completion engine.

A request's life in this process:
1. `GenerateRequest` (no KV handle) -> `LLMEngine.add_request` -> scheduler `waiting`
   (PROMPT mode: every step is a prompt step; long prompts are chunked as the scheduler says).
2. The step that completes the prompt samples the first token. If that already finishes the
   request (EOS, max_tokens 1) its blocks are freed and the delta carries the finish reason.
3. Otherwise the scheduler hands the sequence off with its blocks (`handed_off`); the exporter
   holds them under a lease keyed by request id and the delta carries the first token and the
   encoded `KVHandle` for the router to pass to a completion engine.
4. The completion engine claims the lease, pulls the blocks over NIXL and sends a release note;
   or nobody claims it and it expires; or the router aborts it. Each way the exporter's
   `on_free` fires (on its poller thread); the loop thread then returns the blocks to the
   scheduler in `tick()`, the only thread that touches the scheduler.
"""

from __future__ import annotations

import collections
import logging
import threading

from baton.engine import LLMEngine
from baton.normal_worker import NormalWorker, error_delta, to_delta
from baton.protocol import EngineStats, GenerateRequest, TokenDelta
from baton.registry import EngineRecord
from kv_transfer import protocol as kvproto
from kv_transfer.config import TransferConfig
from kv_transfer.exporter import KVExporter

logger = logging.getLogger(__name__)


class PromptWorker(NormalWorker):
    role = "prompt"

    def __init__(self, engine: LLMEngine, transfer: TransferConfig, engine_id: str,
                 advertise_host: str = ""):
        super().__init__(engine)
        self._freed: collections.deque[str] = collections.deque()  # filled by the exporter thread
        self._lock = threading.Lock()
        self.exporter = KVExporter(engine.kv_cache, transfer, engine.kv_fingerprint(),
                                   on_free=self._on_lease_end, engine_id=engine_id)
        if advertise_host:
            # Bound to a wildcard (or a pod-local) address: KV handles must name the address a
            # completion engine on another host can dial.
            port = self.exporter.address.rsplit(":", 1)[1]
            self.exporter.address = f"tcp://{advertise_host}:{port}"
        self.num_handed_off = 0

    @property
    def side_channel(self) -> str:
        return self.exporter.address

    def _on_lease_end(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._freed.append(request_id)

    def add_request(self, req: GenerateRequest) -> list[TokenDelta]:
        if req.kv_handle:
            return [error_delta(req.req_id, "a prompt engine takes no KV handle")]
        return super().add_request(req)

    def abort_request(self, req_id: str) -> list[TokenDelta]:
        if self.engine.abort_request(req_id):
            return []  # still prefilling: the final delta comes with the next step
        # Already handed off: drop the lease (a claimed one ends when its reader releases).
        if self.exporter.abort(req_id):
            return [TokenDelta(req_id, finish_reason="abort")]
        return []  # unknown, finished, or claimed (freed once its reader is done)

    def step(self) -> list[TokenDelta]:
        deltas = []
        for out in self.engine.step():
            delta = to_delta(out)
            delta.num_prompt_tokens = out.num_prompt_tokens
            if out.handed_off_block_ids is not None:
                handle = self.exporter.hold(out.request_id, list(out.handed_off_block_ids),
                                            out.num_prompt_tokens)
                delta.kv_handle = kvproto.encode(handle)
                self.num_handed_off += 1
            deltas.append(delta)
        return deltas

    def tick(self) -> list[TokenDelta]:
        with self._lock:
            freed, self._freed = list(self._freed), collections.deque()
        for request_id in freed:
            self.engine.release_handed_off(request_id)
        return []

    def fill_stats(self, stats: EngineStats) -> None:
        super().fill_stats(stats)
        stats.extra["num_handed_off"] = float(self.engine.scheduler.num_handed_off())
        for key, value in self.exporter.metrics().items():
            if isinstance(value, (int, float)):
                stats.extra[f"kv_{key}"] = float(value)

    def fill_record(self, record: EngineRecord) -> None:
        super().fill_record(record)
        record.side_channel = self.exporter.address

    def close(self) -> None:
        self.exporter.close()
