"""How loaded each engine is, as this router sees it, and which engines failed lately.

A request's life on one engine, as counted here (router/dispatch.py calls each step):
  1. `acquire(address, num_blocks)` when a leg is sent: one more request in flight there, and
     the blocks the selection policy said it adds (router/selection.py's Choice);
  2. `add_blocks(address, -n)` when part of the work is done early (a prompt engine's blocks
     once its first token is out: they wait for the pull only);
  3. `release(address, num_blocks)` when the leg ends, however it ends;
  4. `mark_failed(address)` when the engine failed it: the engine is passed over for
     `failure_cooldown_s` while another candidate is healthy.
An engine's load is the registry's (updated once per heartbeat) plus this router's requests
in flight there since, so a burst spreads out at once.
"""

from __future__ import annotations

import time

from baton.ops.registry import EngineRecord


class LoadTracker:
    """Requests and active blocks in flight per engine address, and when each last failed."""

    def __init__(self, failure_cooldown_s: float):
        self.failure_cooldown_s = failure_cooldown_s
        self._num_requests: dict[str, int] = {}  # address -> requests in flight from here
        self._num_blocks: dict[str, int] = {}  # address -> active blocks (cache-aware cost)
        self._failed_at: dict[str, float] = {}  # address -> monotonic time of its last failure

    def num_requests(self, address: str) -> int:
        return self._num_requests.get(address, 0)

    def num_blocks(self, address: str) -> int:
        return self._num_blocks.get(address, 0)

    def load(self, record: EngineRecord) -> float:
        """The registry's load plus this router's requests sent since: lower is better."""
        return record.load + self.num_requests(record.address)

    def acquire(self, address: str, num_blocks: int = 0) -> None:
        self._num_requests[address] = self.num_requests(address) + 1
        self.add_blocks(address, num_blocks)

    def release(self, address: str, num_blocks: int = 0) -> None:
        self._num_requests[address] = max(0, self.num_requests(address) - 1)
        self.add_blocks(address, -num_blocks)

    def add_blocks(self, address: str, num_blocks: int) -> None:
        """Move an engine's active blocks (cache-aware cost) by `num_blocks`."""
        if num_blocks:
            self._num_blocks[address] = max(0, self.num_blocks(address) + num_blocks)

    def mark_failed(self, address: str) -> None:
        self._failed_at[address] = time.monotonic()

    def is_healthy(self, address: str, now: float) -> bool:
        """Not failed within the cooldown."""
        return now - self._failed_at.get(address, -1e9) >= self.failure_cooldown_s
