"""Completion side: pulls a prompt's KV blocks from the exporter named by a KVHandle.

Life of one pull on the completion engine:
1. the engine allocated local blocks and calls start_pull(handle, local_block_ids): PENDING.
2. the poller thread handshakes with the handle's exporter unless a handshake with that
   instance is cached (a new instance id redoes it; a differing fingerprint fails the pull).
3. it claims the lease over the side channel; a claim on an expired, unknown or claimed lease
   fails the pull (nothing was transferred).
4. it posts a NIXL READ of the blocks carrying the Release note: TRANSFERRING.
5. NIXL completes, or raises (FAILED: peer_gone, transfer_error), or the deadline passes
   (FAILED: timeout, the transfer cancelled first). What landed is verified against the
   handle's checksums (kv_transfer/integrity.py): DONE, or FAILED checksum_mismatch, so a
   request never decodes KV other than what its prompt engine computed. The engine sees the
   result through poll(), collect(), on_result or transfer(); only then may it reuse the
   local blocks.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from kv_transfer import protocol as proto
from kv_transfer.agent import NixlAgent
from kv_transfer.blocks import check_block_ids
from kv_transfer.config import PoolSpec, TransferConfig
from kv_transfer.errors import BadHandleError, FailReason, KVTransferError, TransferState
from kv_transfer.integrity import BlockReader, FaultPlan
from kv_transfer.pull_loop import PullLoop
from kv_transfer.pulls import Pull, PullTable, TransferResult

logger = logging.getLogger(__name__)


class KVImporter:
    """NIXL agent + side-channel clients of one completion engine.

    on_result(result), if given, is called from the poller thread for every finished pull
    (e.g. loop.call_soon_threadsafe(...)); it must not block.
    """

    def __init__(self, pool: Any, config: TransferConfig, fingerprint: proto.Fingerprint,
                 engine_id: str = "completion-0",
                 on_result: Callable[[TransferResult], None] | None = None,
                 faults: FaultPlan | None = None) -> None:
        if config.op != "READ":
            raise ValueError(f"KVImporter supports op='READ' only, got {config.op!r}")
        self.config = config
        self.spec = PoolSpec.of(pool)
        self._pool = pool
        self.fingerprint = fingerprint
        self.engine_id = engine_id
        self.agent = NixlAgent(f"{engine_id}-{uuid.uuid4().hex[:16]}", self.spec,
                               config.ucx_env)
        self._pulls = PullTable(on_result)
        self._loop = PullLoop(self.agent, config, BlockReader(pool, self.spec), fingerprint,
                              self._pulls, zmq.Context.instance(), faults or FaultPlan())
        self._thread = threading.Thread(target=self._loop.run, name=f"kv-importer-{engine_id}",
                                        daemon=True)
        self._thread.start()
        logger.info("KV importer %s: %d blocks x %d bytes, %s", engine_id,
                    self.spec.num_blocks, self.spec.block_bytes, fingerprint.describe())

    def start_pull(self, handle: proto.KVHandle, local_block_ids: list[int],
                   first_block: int = 0) -> None:
        """Begin pulling handle's blocks from `first_block` on into local_block_ids (the ones
        before it are already here: a prefix-cache hit; the lease is claimed whole and released
        all the same); never blocks. A bad handle becomes a FAILED result; bad local ids or a
        duplicate request id raise ValueError."""
        try:
            local = check_block_ids(local_block_ids, self.spec.num_blocks, "local block ids")
        except BadHandleError as exc:
            raise ValueError(str(exc)) from None
        self._pulls.add(Pull(handle, local, time.monotonic(), first_block=first_block))

    def abort(self, request_id: str) -> None:
        """Stop a pull; its result (FAILED aborted, or DONE if it won the race) still comes,
        and the local blocks are safe to reuse only then."""
        self._pulls.abort(request_id)

    def poll(self, request_id: str) -> TransferState:
        return self._pulls.state(request_id)

    def collect(self) -> list[TransferResult]:
        """Finished pulls since the last collect; their request ids are forgotten."""
        return self._pulls.collect()

    def transfer(self, handle: proto.KVHandle, local_block_ids: list[int],
                 timeout_s: float | None = None) -> TransferResult:
        """Blocking pull (for tests and tools); the copy itself runs in the poller thread."""
        rid = handle.request_id
        self.start_pull(handle, local_block_ids)
        limit = timeout_s or (self.config.transfer_timeout_s + 3 * self.config.rpc_timeout_s)
        if not self._pulls.wait(rid, limit):
            self.abort(rid)
            self._pulls.wait(rid, self.config.transfer_timeout_s)
        result = self._pulls.take(rid)
        if result is None:
            raise KVTransferError(f"pull of {rid!r} did not finish", FailReason.TIMEOUT)
        return result

    def num_pending(self) -> int:
        return self._pulls.num_pending()

    def metrics(self) -> dict[str, Any]:
        return self._pulls.metrics()

    def close(self) -> None:
        """Stop the poller (pending pulls fail with 'closed'), close sockets and the agent."""
        if self._loop.is_stopping:
            return
        self._loop.stop()
        self._thread.join(timeout=self.config.transfer_timeout_s + 5)
        self.agent.close()
        self._pulls.close()
