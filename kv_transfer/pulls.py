"""Per-pull state, and the table of pulls that the importer's engine-facing API and its poller
thread share.

The engine's threads put new pulls and aborts into the table's inbox and read states and results
from it; the poller thread (pull_loop.py) takes the inbox, advances the pulls, and writes their
states and results back. Everything behind the table's lock; the poller waits on its wake pipe.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from kv_transfer import protocol as proto
from kv_transfer.errors import FailReason, TransferState
from kv_transfer.peers import Peer

logger = logging.getLogger(__name__)


class TransferResult(msgspec.Struct, omit_defaults=True):
    request_id: str
    state: TransferState  # DONE or FAILED
    reason: str = ""  # a FailReason value when FAILED
    message: str = ""
    num_bytes: int = 0
    num_descs: int = 0
    seconds: float = 0.0  # from start_pull to the result
    xfer_seconds: float = 0.0  # NIXL transfer only (post to completion)


@dataclasses.dataclass
class Pull:
    handle: proto.KVHandle
    local_ids: list[int]  # where handle.block_ids[first_block:] land
    started: float
    first_block: int = 0  # the handle's blocks before this are already here (prefix cache)
    state: TransferState = TransferState.PENDING
    peer: Peer | None = None
    seq: int = -1  # claim in flight when >= 0
    deadline: float = 0.0
    xfer: object = None
    num_descs: int = 0
    posted: float = 0.0
    xfer_seconds: float = 0.0
    is_claimed: bool = False
    is_aborted: bool = False
    fail: tuple[FailReason, str] | None = None  # decided, waiting for the xfer to let go


class PullTable:
    """States, results and counters of one importer's pulls, and the inbox to its poller.

    on_result(result), if given, is called from the poller thread for every finished pull.
    """

    def __init__(self, on_result: Callable[[TransferResult], None] | None = None) -> None:
        self._on_result = on_result
        self._lock = threading.Lock()
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._states: dict[str, TransferState] = {}
        self._finished: dict[str, TransferResult] = {}
        self._events: dict[str, threading.Event] = {}
        self._counters = collections.Counter[str]()
        self._last: dict[str, float] = {}
        self.wake_fd, self._wake_w = os.pipe()  # the poller polls wake_fd
        os.set_blocking(self._wake_w, False)

    # ---- engine side (any thread) ----

    def add(self, pull: Pull) -> None:
        """Queue a new pull (PENDING); ValueError if its request id already has one."""
        rid = pull.handle.request_id
        with self._lock:
            if rid in self._states:
                raise ValueError(f"request {rid!r} already has a pull")
            self._states[rid] = TransferState.PENDING
            self._events[rid] = threading.Event()
            self._inbox.append(("pull", pull))
        self.wake()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self.wake()

    def state(self, request_id: str) -> TransferState:
        with self._lock:
            return self._states[request_id]

    def collect(self) -> list[TransferResult]:
        """Finished pulls since the last collect; their request ids are forgotten."""
        with self._lock:
            done = list(self._finished.values())
            for r in done:
                self._forget(r.request_id)
        return done

    def wait(self, request_id: str, timeout_s: float) -> bool:
        """Block until the pull of `request_id` finished (True) or `timeout_s` passed."""
        with self._lock:
            event = self._events[request_id]
        return event.wait(timeout_s)

    def take(self, request_id: str) -> TransferResult | None:
        """The finished pull's result, forgetting it; None while it is unfinished."""
        with self._lock:
            result = self._finished.get(request_id)
            if result is not None:
                self._forget(request_id)
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

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe already wakes the poller

    def close(self) -> None:
        """After the poller stopped: close the wake pipe."""
        os.close(self.wake_fd)
        os.close(self._wake_w)

    # ---- poller side ----

    def take_inbox(self) -> list[tuple[str, Any]]:
        """New ("pull", Pull) and ("abort", request_id) items, oldest first."""
        with self._lock:
            items = list(self._inbox)
            self._inbox.clear()
        return items

    def clear_wake(self) -> None:
        os.read(self.wake_fd, 4096)

    def set_state(self, request_id: str, state: TransferState) -> None:
        with self._lock:
            self._states[request_id] = state

    def count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def add_time(self, name: str, seconds: float) -> None:
        with self._lock:
            self._counters[name] += seconds

    def finish(self, result: TransferResult) -> None:
        """Record a finished pull, wake its waiter, and tell on_result."""
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

    def _forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._finished.pop(request_id, None)
        self._events.pop(request_id, None)
