"""The prompt side of the hand-off: a finished prompt's KV blocks under a lease until pulled.

1. The engine's step reports a prompt that left the scheduler with its blocks
   (`RequestOutput.handed_off_block_ids`); `hold` puts them under a lease in the exporter, keyed
   by request id, and returns the encoded `KVHandle` the router carries to a completion engine,
   with the blocks' checksums (the exporter takes them here, after the prompt step and before
   the handle leaves, as `--kv-checksum` says: kv_transfer/integrity.py).
2. The completion engine claims the lease, READs the blocks over NIXL and sends a release note;
   or nobody claims it and it expires; or the router aborts it (`abort`). Each way the exporter's
   `on_free` fires on its poller thread and queues the request id.
3. `release_ended` (the service loop's thread, the only one that touches the scheduler) returns
   those blocks to the scheduler (`release_handed_off`).
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from kv_transfer import protocol as kvproto
from kv_transfer.config import TransferConfig
from kv_transfer.exporter import KVExporter
from kv_transfer.integrity import FaultPlan

logger = logging.getLogger(__name__)


class HandOff:
    """Leases on handed-off prompts, and the return of their blocks when a lease ends."""

    def __init__(self, kv_cache, transfer: TransferConfig,
                 fingerprint: kvproto.Fingerprint, engine_id: str, advertise_host: str = "",
                 faults: FaultPlan | None = None):
        self._ended: collections.deque[str] = collections.deque()  # filled by the exporter thread
        self._lock = threading.Lock()
        self.exporter = KVExporter(kv_cache, transfer, fingerprint, on_free=self._on_lease_end,
                                   engine_id=engine_id, faults=faults)
        if advertise_host:
            # Bound to a wildcard (or a pod-local) address: KV handles must name the address a
            # completion engine on another host can dial.
            port = self.exporter.address.rsplit(":", 1)[1]
            self.exporter.address = f"tcp://{advertise_host}:{port}"

    @property
    def side_channel(self) -> str:
        return self.exporter.address

    def _on_lease_end(self, request_id: str, block_ids: list[int]) -> None:
        with self._lock:
            self._ended.append(request_id)

    def hold(self, request_id: str, block_ids: list[int], num_prompt_tokens: int,
             block_keys: list[int]) -> bytes:
        """Lease a handed-off prompt's blocks; the encoded KV handle for the router, with the
        prefix-cache keys of the prompt's full blocks (a completion engine that holds some of
        them pulls only the rest). When the lease ends the blocks enter this engine's cache."""
        handle = self.exporter.hold(request_id, block_ids, num_prompt_tokens,
                                    block_keys=block_keys)
        return kvproto.encode(handle)

    def abort(self, request_id: str) -> bool:
        """Drop an unclaimed lease (a claimed one ends when its reader releases it)."""
        return self.exporter.abort(request_id)

    def release_ended(self, release: Callable[[str], None]) -> None:
        """Return the blocks of every lease that ended since the last call."""
        with self._lock:
            ended, self._ended = list(self._ended), collections.deque()
        for request_id in ended:
            release(request_id)

    def metrics(self) -> dict:
        return self.exporter.metrics()

    def close(self) -> None:
        self.exporter.close()
