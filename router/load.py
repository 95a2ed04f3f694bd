"""How loaded each engine is, as this router sees it, and which engines failed lately.

A request's life on one engine, as counted here (router/dispatch.py calls each step):
  1. `acquire(address, num_blocks, work)` when a leg is sent: one more request in flight there,
     the blocks the selection policy said it adds (router/selection.py's Choice), and its
     `LegWork`: the prompt tokens it must prefill there (none on a completion engine) and the
     tokens it attends to (router/path.py predicts queueing and decode steps from them);
  2. `prefilled(address, work)` when its first token is out: it decodes there now (a prompt
     engine's request only waits for its pull); `add_blocks(address, -n)` when part of the work
     is done early (a prompt engine's blocks once its first token is out);
  3. `release(address, num_blocks, work)` when the leg ends, however it ends (`work` as it is
     then: a leg that never prefilled leaves the prefill queue too);
  4. `mark_failed(address)` when the engine failed it: the engine is passed over for
     `failure_cooldown_s` while another candidate is healthy.
An engine's load is the registry's (updated once per heartbeat) plus this router's requests
in flight there since, so a burst spreads out at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from baton.ops.registry import EngineRecord


@dataclass
class LegWork:
    """What one leg asks of its engine, as far as the router can tell."""

    num_prefill_tokens: int = 0  # prompt tokens still to prefill there (0 once its first token)
    num_context_tokens: int = 0  # tokens its decode attends to (the prompt, a migration's outputs)


@dataclass
class EngineWork:
    """The sum of this router's legs in flight on one engine."""

    num_prefilling: int = 0  # legs waiting for their first token
    num_prefill_tokens: int = 0  # prompt tokens they still have to prefill
    num_context_tokens: int = 0  # tokens the legs there attend to


class LoadTracker:
    """Requests and active blocks in flight per engine address, and when each last failed."""

    def __init__(self, failure_cooldown_s: float):
        self.failure_cooldown_s = failure_cooldown_s
        self._num_requests: dict[str, int] = {}  # address -> requests in flight from here
        self._num_blocks: dict[str, int] = {}  # address -> active blocks (cache-aware cost)
        self._failed_at: dict[str, float] = {}  # address -> monotonic time of its last failure
        self._work: dict[str, EngineWork] = {}  # address -> what its legs ask of it
        self._changed_at: dict[str, float] = {}  # address -> wall time its work last changed

    def num_requests(self, address: str) -> int:
        return self._num_requests.get(address, 0)

    def num_blocks(self, address: str) -> int:
        return self._num_blocks.get(address, 0)

    def load(self, record: EngineRecord) -> float:
        """The registry's load plus this router's requests sent since: lower is better."""
        return record.load + self.num_requests(record.address)

    def work(self, address: str) -> EngineWork:
        return self._work.get(address) or EngineWork()

    def acquire(self, address: str, num_blocks: int = 0, work: LegWork | None = None) -> None:
        self._num_requests[address] = self.num_requests(address) + 1
        self._changed_at[address] = time.time()
        self.add_blocks(address, num_blocks)
        if work is not None:
            self._add_work(address, work, +1)

    def prefilled(self, address: str, work: LegWork) -> None:
        """The leg's first token is out: it leaves the prefill queue (`work` is zeroed)."""
        if work.num_prefill_tokens:
            self._add_work(address, LegWork(work.num_prefill_tokens), -1)
            work.num_prefill_tokens = 0

    def release(self, address: str, num_blocks: int = 0, work: LegWork | None = None) -> None:
        self._num_requests[address] = max(0, self.num_requests(address) - 1)
        self._changed_at[address] = time.time()
        self.add_blocks(address, -num_blocks)
        if work is not None:
            self._add_work(address, work, -1)

    def changed_at(self, address: str) -> float:
        """Wall time (as the registry's `updated_at`) this router's work there last changed."""
        return self._changed_at.get(address, 0.0)

    def _add_work(self, address: str, work: LegWork, sign: int) -> None:
        total = self._work.setdefault(address, EngineWork())
        if work.num_prefill_tokens:
            total.num_prefilling = max(0, total.num_prefilling + sign)
            total.num_prefill_tokens = max(0, total.num_prefill_tokens
                                           + sign * work.num_prefill_tokens)
        total.num_context_tokens = max(0, total.num_context_tokens
                                       + sign * work.num_context_tokens)

    def add_blocks(self, address: str, num_blocks: int) -> None:
        """Move an engine's active blocks (cache-aware cost) by `num_blocks`."""
        if num_blocks:
            self._num_blocks[address] = max(0, self.num_blocks(address) + num_blocks)

    def mark_failed(self, address: str) -> None:
        self._failed_at[address] = time.monotonic()

    def is_healthy(self, address: str, now: float) -> bool:
        """Not failed within the cooldown."""
        return now - self._failed_at.get(address, -1e9) >= self.failure_cooldown_s
