"""Completion side: pulls a prompt's KV blocks from the exporter named by a KVHandle.

Life of one pull on the completion engine:
1. the engine allocated local blocks and calls start_pull(handle, local_block_ids): PENDING.
2. the poller thread handshakes with the handle's exporter unless a handshake with that
   instance is cached (a new instance id redoes it; a differing fingerprint fails the pull).
3. it claims the lease over the side channel; a claim on an expired, unknown or claimed lease
   fails the pull (nothing was transferred).
4. it posts a NIXL READ of the blocks carrying the Release note: TRANSFERRING.
5. NIXL completes (DONE) or raises (FAILED: peer_gone, transfer_error), or the deadline passes
   (FAILED: timeout, the transfer cancelled first). The engine sees the result through
   poll(), collect(), on_result or transfer(); only then may it reuse the local blocks.
"""

from __future__ import annotations

import collections
import logging
import os
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
from kv_transfer.pull_loop import PullLoop
from kv_transfer.pulls import Pull, TransferResult

logger = logging.getLogger(__name__)



class KVImporter:
    """NIXL agent + side-channel clients of one completion engine.

    on_result(result), if given, is called from the poller thread for every finished pull
    (e.g. loop.call_soon_threadsafe(...)); it must not block.
    """

    def __init__(self, pool: Any, config: TransferConfig, fingerprint: proto.Fingerprint,
                 engine_id: str = "completion-0",
                 on_result: Callable[[TransferResult], None] | None = None) -> None:
        if config.op != "READ":
            raise ValueError(f"KVImporter supports op='READ' only, got {config.op!r}")
        self.config = config
        self.spec = PoolSpec.of(pool)
        self._pool = pool
        self.fingerprint = fingerprint
        self.engine_id = engine_id
        self._on_result = on_result
        self.agent = NixlAgent(f"{engine_id}-{uuid.uuid4().hex[:16]}", self.spec,
                               config.ucx_env)
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._states: dict[str, TransferState] = {}
        self._finished: dict[str, TransferResult] = {}
        self._events: dict[str, threading.Event] = {}
        self._counters = collections.Counter[str]()
        self._last: dict[str, float] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._loop = PullLoop(self)
        self._thread = threading.Thread(target=self._loop.run, name=f"kv-importer-{engine_id}",
                                        daemon=True)
        self._thread.start()
        logger.info("KV importer %s: %d blocks x %d bytes, %s", engine_id,
                    self.spec.num_blocks, self.spec.block_bytes, fingerprint.describe())

    # ---- engine-facing API (any thread) ----

    def start_pull(self, handle: proto.KVHandle, local_block_ids: list[int]) -> None:
        """Begin pulling handle's blocks into local_block_ids; never blocks. A bad handle
        becomes a FAILED result; bad local ids or a duplicate request id raise ValueError."""
        try:
            local = check_block_ids(local_block_ids, self.spec.num_blocks, "local block ids")
        except BadHandleError as exc:
            raise ValueError(str(exc)) from None
        with self._lock:
            if handle.request_id in self._states:
                raise ValueError(f"request {handle.request_id!r} already has a pull")
            self._states[handle.request_id] = TransferState.PENDING
            self._events[handle.request_id] = threading.Event()
            self._inbox.append(("pull", Pull(handle, local, time.monotonic())))
        self._wake()

    def abort(self, request_id: str) -> None:
        """Stop a pull; its result (FAILED aborted, or DONE if it won the race) still comes,
        and the local blocks are safe to reuse only then."""
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake()

    def poll(self, request_id: str) -> TransferState:
        with self._lock:
            return self._states[request_id]

    def collect(self) -> list[TransferResult]:
        """Finished pulls since the last collect; their request ids are forgotten."""
        with self._lock:
            done = list(self._finished.values())
            for r in done:
                self._forget(r.request_id)
        return done

    def transfer(self, handle: proto.KVHandle, local_block_ids: list[int],
                 timeout_s: float | None = None) -> TransferResult:
        """Blocking pull (for tests and tools); the copy itself runs in the poller thread."""
        self.start_pull(handle, local_block_ids)
        with self._lock:
            event = self._events[handle.request_id]
        limit = timeout_s or (self.config.transfer_timeout_s + 3 * self.config.rpc_timeout_s)
        if not event.wait(limit):
            self.abort(handle.request_id)
            event.wait(self.config.transfer_timeout_s)
        with self._lock:
            result = self._finished.get(handle.request_id)
            if result is None:
                raise KVTransferError(f"pull of {handle.request_id!r} did not finish",
                                      FailReason.TIMEOUT)
            self._forget(handle.request_id)
        return result

    def num_pending(self) -> int:
        with self._lock:
            return len(self._states) - len(self._finished)

    def metrics(self) -> dict[str, Any]:
        with self._lock:
            snap: dict[str, Any] = dict(self._counters)
            snap["pulls_active"] = len(self._states) - len(self._finished)
            snap.update({f"last_{k}": v for k, v in self._last.items()})
        return snap

    def close(self) -> None:
        """Stop the poller (pending pulls fail with 'closed'), close sockets and the agent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake()
        self._thread.join(timeout=self.config.transfer_timeout_s + 5)
        self.agent.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # ---- shared with the poller ----

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe already wakes the poller

    def _forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._finished.pop(request_id, None)
        self._events.pop(request_id, None)

    def _set_state(self, request_id: str, state: TransferState) -> None:
        with self._lock:
            self._states[request_id] = state

    def _finish(self, result: TransferResult) -> None:
        with self._lock:
            self._states[result.request_id] = result.state
            self._finished[result.request_id] = result
            event = self._events.get(result.request_id)
            if result.state == TransferState.DONE:
                self._counters["transfers_done"] += 1
                self._counters["bytes_total"] += result.num_bytes
                self._counters["descs_total"] += result.num_descs
                self._counters["seconds_total"] += result.seconds
                self._last = {"bytes": result.num_bytes, "descs": result.num_descs,
                              "seconds": result.seconds}
            else:
                self._counters["transfers_failed"] += 1
                self._counters[f"failed_{result.reason}"] += 1
        if event is not None:
            event.set()
        if self._on_result is not None:
            try:
                self._on_result(result)
            except Exception:
                logger.exception("on_result(%s) raised", result.request_id)

