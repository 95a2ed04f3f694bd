"""The COMPLETION role: pull a prompt's KV from a prompt engine, then decode.

A request's life in this process:
1. `GenerateRequest` with a KV handle and the first token -> the handle is decoded and checked
   (a bad one finishes the request at once) -> `admission` queue, in arrival order.
2. `tick()` admits from the head: the scheduler allocates blocks for the whole prompt
   (`allocate_prompted`: OK, LATER = wait for room, keep the order; NEVER = cannot ever fit,
   finish with `insufficient_system_resource`) and the importer starts pulling into them.
3. The importer's result: DONE -> `commit_prompted` (the sequence joins `prompted`, then
   `running` on the next decode step); FAILED -> `free_prompted`, finish with
   `kv_transfer_failed` and the importer's reason (peer gone, lease expired, timeout...).
4. Decode steps stream token deltas; the first token came from the prompt engine and is not
   sent again. Abort at any stage frees everything: in admission it just leaves; during the
   pull the importer is told and the blocks are freed once its result arrives (never while a
   NIXL read may still write into them); in `running` the engine aborts the sequence.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import msgspec

from baton.engine import LLMEngine
from baton.normal_worker import NormalWorker, error_delta, to_sampling_params
from baton.protocol import EngineStats, GenerateRequest, TokenDelta
from baton.registry import EngineRecord
from baton.sampler import SamplingParams
from baton.scheduler import AllocStatus
from kv_transfer import protocol as kvproto
from kv_transfer.config import TransferConfig
from kv_transfer.errors import TransferState
from kv_transfer.importer import KVImporter

logger = logging.getLogger(__name__)


@dataclass
class _Admission:
    req: GenerateRequest
    handle: kvproto.KVHandle
    params: SamplingParams
    aborted: bool = False


class CompletionWorker(NormalWorker):
    role = "completion"

    def __init__(self, engine: LLMEngine, transfer: TransferConfig, engine_id: str):
        super().__init__(engine)
        self.importer = KVImporter(engine.kv_cache, transfer, engine.kv_fingerprint(),
                                   engine_id=engine_id)
        self.admission: collections.deque[_Admission] = collections.deque()
        self.pulling: dict[str, _Admission] = {}
        self.num_pulls_done = 0
        self.num_pulls_failed = 0

    # --- requests --------------------------------------------------------------------------
    def add_request(self, req: GenerateRequest) -> list[TokenDelta]:
        try:
            handle = self._check(req)
            params = to_sampling_params(req.sampling)
        except ValueError as exc:
            return [error_delta(req.req_id, str(exc), reason="bad_request")]
        self.admission.append(_Admission(req, handle, params))
        return []

    def _check(self, req: GenerateRequest) -> kvproto.KVHandle:
        if not req.kv_handle:
            raise ValueError("a completion engine needs the prompt's KV handle")
        try:
            handle = kvproto.decode_handle(req.kv_handle)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"undecodable KV handle: {exc}") from None
        num_prompt = len(req.prompt_token_ids)
        if handle.request_id != req.req_id:
            raise ValueError(f"KV handle is for {handle.request_id!r}, not {req.req_id!r}")
        if handle.num_tokens != num_prompt:
            raise ValueError(f"KV handle covers {handle.num_tokens} tokens, prompt has {num_prompt}")
        block_size = self.engine.config.block_size
        if len(handle.block_ids) != -(-num_prompt // block_size):
            raise ValueError(f"KV handle has {len(handle.block_ids)} blocks for {num_prompt} "
                             f"tokens of block size {block_size}")
        if not 0 <= req.first_token_id < self.engine.model_config.vocab_size:
            raise ValueError(f"first token id {req.first_token_id} out of range")
        return handle

    def abort_request(self, req_id: str) -> list[TokenDelta]:
        for adm in self.admission:
            if adm.req.req_id == req_id:
                self.admission.remove(adm)
                return [TokenDelta(req_id, finish_reason="abort")]
        if req_id in self.pulling:
            self.pulling[req_id].aborted = True
            self.importer.abort(req_id)  # blocks are freed when the pull's result arrives
            return []
        self.engine.abort_request(req_id)
        return []

    # --- every iteration -------------------------------------------------------------------
    def tick(self) -> list[TokenDelta]:
        deltas = self._collect_pulls()
        while self.admission:
            adm = self.admission[0]
            status, block_ids = self.engine.add_prompted_request(
                adm.req.req_id, adm.req.prompt_token_ids, adm.req.first_token_id,
                adm.req.first_logprob, adm.params)
            if status == AllocStatus.LATER:
                break  # no room now: keep arrival order, retry when blocks free up
            self.admission.popleft()
            if status == AllocStatus.NEVER:
                deltas.append(error_delta(adm.req.req_id, "the prompt needs more KV blocks than "
                                          "this engine has", "insufficient_system_resource"))
                continue
            self.pulling[adm.req.req_id] = adm
            self.importer.start_pull(adm.handle, [int(b) for b in block_ids])
        return deltas

    def _collect_pulls(self) -> list[TokenDelta]:
        deltas = []
        for result in self.importer.collect():
            adm = self.pulling.pop(result.request_id, None)
            if adm is None:
                continue
            if result.state == TransferState.DONE and not adm.aborted:
                self.num_pulls_done += 1
                self.engine.commit_prompted(result.request_id)
                continue
            self.engine.free_prompted(result.request_id)
            if adm.aborted:
                deltas.append(TokenDelta(result.request_id, finish_reason="abort"))
            else:
                self.num_pulls_failed += 1
                logger.warning("KV pull for %s failed: %s %s", result.request_id, result.reason,
                               result.message)
                deltas.append(error_delta(result.request_id,
                                          f"KV transfer failed ({result.reason}): {result.message}",
                                          "kv_transfer_failed"))
        return deltas

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.admission)

    def has_pending(self) -> bool:
        """Pulls in flight: the importer's thread does the work; the loop only waits."""
        return bool(self.pulling)

    def fill_stats(self, stats: EngineStats) -> None:
        super().fill_stats(stats)
        stats.num_waiting += len(self.admission) + len(self.pulling)
        stats.extra["kv_pulls_done"] = float(self.num_pulls_done)
        stats.extra["kv_pulls_failed"] = float(self.num_pulls_failed)
        for key, value in self.importer.metrics().items():
            if isinstance(value, (int, float)):
                stats.extra[f"kv_{key}"] = float(value)

    def fill_record(self, record: EngineRecord) -> None:
        super().fill_record(record)
        record.num_waiting += len(self.admission) + len(self.pulling)

    def close(self) -> None:
        self.importer.close()
