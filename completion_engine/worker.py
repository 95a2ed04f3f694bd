"""The COMPLETION role: pull a prompt's KV from a prompt engine, then decode.

A request's life in this process:
1. `GenerateRequest` with a KV handle and the first token -> the handle is decoded and checked
   (a bad one finishes the request at once) -> the admission queue (admission.py).
2. Every loop iteration (`tick`) admission allocates blocks from the head of its queue, starts
   KV pulls into them, and commits the pulled prompts (or fails them with a reason).
3. Decode steps stream token deltas; the first token came from the prompt engine and is not
   sent again.
4. Abort at any stage frees everything: admission handles the queued and pulling stages; a
   decoding request is aborted by the engine.
"""

from __future__ import annotations

import logging

from baton.engine import LLMEngine
from baton.ops.registry import EngineRecord
from baton.protocol import COMPLETION, EngineStats, GenerateRequest, TokenDelta
from baton.service.metrics import INTEGRITY_PREFIX
from baton.service.worker import EngineWorker, error_delta, to_sampling_params
from completion_engine.admission import Admission, MinPullTime, PullObserver
from kv_transfer.config import TransferConfig
from kv_transfer.errors import INTEGRITY_FAILURES
from kv_transfer.integrity import FaultPlan

logger = logging.getLogger(__name__)


class CompletionWorker(EngineWorker):
    role = COMPLETION

    def __init__(self, engine: LLMEngine, transfer: TransferConfig, engine_id: str,
                 on_pull_result: PullObserver | None = None, faults: FaultPlan | None = None,
                 min_pull_s: MinPullTime | None = None):
        """`min_pull_s`: a mock engine's (baton/perf/mock_runner.py `pull_s`): each pull
        lands no sooner than the profile's transfer time for its blocks."""
        super().__init__(engine)
        self.admission = Admission(engine, engine.kv_cache, transfer, self.kv_fingerprint(),
                                   engine_id, on_pull_result, faults, min_pull_s)

    def add_request(self, req: GenerateRequest) -> list[TokenDelta]:
        try:
            self.admission.add(req, to_sampling_params(req.sampling))
        except ValueError as exc:
            return [error_delta(req.req_id, str(exc), reason="bad_request")]
        return []

    def abort_request(self, req_id: str) -> list[TokenDelta]:
        deltas = self.admission.abort(req_id)
        if deltas is not None:
            return deltas
        self.engine.abort_request(req_id)
        return []  # the final delta (reason abort) comes with the next step

    def tick(self) -> list[TokenDelta]:
        return self.admission.admit()

    def has_work(self) -> bool:
        return self.engine.has_unfinished() or bool(self.admission.queue)

    def has_pending(self) -> bool:
        """Pulls in flight: the importer's thread does the work; the loop only waits."""
        return bool(self.admission.pulling)

    def fill_stats(self, stats: EngineStats) -> None:
        super().fill_stats(stats)
        stats.num_waiting += self.admission.num_waiting
        stats.extra["kv_pulls_done"] = float(self.admission.num_pulls_done)
        stats.extra["kv_pulls_failed"] = float(self.admission.num_pulls_failed)
        stats.extra["kv_blocks_pulled"] = float(self.admission.num_blocks_pulled)
        stats.extra["kv_blocks_reused"] = float(self.admission.num_blocks_reused)
        pulls = self.admission.metrics()
        for key, value in pulls.items():
            if isinstance(value, (int, float)):
                stats.extra[f"kv_{key}"] = float(value)
        stats.extra[INTEGRITY_PREFIX + "pull"] = float(sum(
            pulls.get(f"failed_{reason.value}", 0) for reason in INTEGRITY_FAILURES))

    def fill_record(self, record: EngineRecord) -> None:
        super().fill_record(record)
        record.num_waiting += self.admission.num_waiting

    def close(self) -> None:
        self.admission.close()
        super().close()
