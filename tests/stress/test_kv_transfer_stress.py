"""KV transfer stress: thousands of pulls with aborts, lease expiries and a peer restart.

Every pull must end DONE (and byte-exact) or FAILED with a reason its event explains; at the
end both pools have every block free and no lease is left. BATON_STRESS_TRANSFERS (default
2000) sets the count; BATON_STRESS_SECONDS keeps it going at least that long.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kv_transfer"))
os.environ.update({"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"})

import kv_peer  # noqa: E402

from kv_transfer import KVImporter, TransferConfig, TransferState  # noqa: E402
from kv_transfer.auth import keys_from_env  # noqa: E402

NUM_BLOCKS, BLOCK_BYTES, MAX_PULL, WINDOW = 2048, 16384, 64, 16
CFG = dict(rpc_timeout_s=1.0, transfer_timeout_s=5.0, claim_ttl_s=8.0, lease_ttl_s=20.0,
           keys=keys_from_env())  # the session's cluster keys (tests/conftest.py)
# Outcomes each event may end in; a plain pull on a live peer must be DONE.
ALLOWED = {
    "plain": {"done"},
    "abort_exporter_before": {"unknown_request", "aborted"},
    "abort_exporter_after": {"done", "unknown_request", "aborted", "already_claimed"},
    "abort_importer": {"done", "aborted"},
    "expire": {"lease_expired"},
}
RESTART_OUTCOMES = {"peer_gone", "peer_restarted"}


class Local:
    def __init__(self) -> None:
        self.data = np.zeros((NUM_BLOCKS, BLOCK_BYTES), dtype=np.uint8)
        self.free = list(range(1, NUM_BLOCKS))

    def is_exact(self, ids: list[int], seed: int) -> bool:
        return all(np.array_equal(self.data[b], kv_peer.pattern(seed, i, BLOCK_BYTES))
                   for i, b in enumerate(ids))


def _event(rng: np.random.Generator) -> str:
    x = rng.random()
    if x < 0.04:
        return "abort_exporter_before"
    if x < 0.07:
        return "abort_exporter_after"
    if x < 0.10:
        return "abort_importer"
    if x < 0.14:
        return "expire"
    return "plain"


class Driver:
    def __init__(self, total: int, seconds: float) -> None:
        self.total, self.seconds = total, seconds
        self.rng = np.random.default_rng(1234)
        self.local = Local()
        self.peer = kv_peer.PeerProcess(NUM_BLOCKS, BLOCK_BYTES, cfg=CFG)
        self.importer = KVImporter(self.local.data, TransferConfig(**CFG), kv_peer.fingerprint())
        self.pending: dict[str, tuple[int, list[int], str, str]] = {}
        self.delayed: list[tuple[float, object, list[int]]] = []
        self.outcomes: dict[str, int] = {}
        self.started = 0
        self.restarted_at = -1

    def run(self) -> None:
        t0 = time.monotonic()
        while (self.started < self.total or time.monotonic() - t0 < self.seconds
               or self.pending):
            self._collect()
            more = self.started < self.total or time.monotonic() - t0 < self.seconds
            if more and len(self.pending) < WINDOW and not self._start_one():
                time.sleep(0.001)
            if self.restarted_at < 0 and self.started >= self.total // 2:
                self._restart()
            self._start_delayed()

    def _start_one(self) -> bool:
        n = int(self.rng.integers(1, MAX_PULL + 1))
        if len(self.local.free) < n:
            return False
        rid, event = f"s{self.started}", _event(self.rng)
        ttl = 0.02 if event == "expire" else None
        handle = self.peer.hold(rid, n, seed=self.started, ttl_s=ttl)
        if handle is None:
            return False  # exporter full until releases land
        ids, self.local.free = self.local.free[:n], self.local.free[n:]
        self.pending[rid] = (self.started, ids, event, handle.instance_id)
        self.started += 1
        if event == "expire":
            self.delayed.append((time.monotonic() + 0.1, handle, ids))
            return True
        if event == "abort_exporter_before":
            self.peer.call("abort", rid)
        self.importer.start_pull(handle, ids)
        if event == "abort_exporter_after":
            self.peer.call("abort", rid)
        elif event == "abort_importer":
            self.importer.abort(rid)
        return True

    def _start_delayed(self) -> None:
        now = time.monotonic()
        for item in [d for d in self.delayed if d[0] <= now]:
            self.delayed.remove(item)
            self.importer.start_pull(item[1], item[2])

    def _collect(self) -> None:
        for r in self.importer.collect():
            seed, ids, event, instance = self.pending.pop(r.request_id)
            outcome = "done" if r.state == TransferState.DONE else r.reason
            allowed = ALLOWED[event]
            if instance != self.peer.instance_id:  # started before the restart
                allowed = allowed | RESTART_OUTCOMES
            assert outcome in allowed, (r, event)
            if outcome == "aborted" and instance == self.peer.instance_id:
                # as the router would: the abort reaches the prompt engine too
                self.peer.call("abort", r.request_id)
            if outcome == "done":
                assert self.local.is_exact(ids, seed), r
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            self.local.free.extend(ids)

    def _restart(self) -> None:
        """SIGKILL the exporter with pulls in flight, then start a new one."""
        self.peer.kill()
        self.restarted_at = self.started
        self.peer = kv_peer.PeerProcess(NUM_BLOCKS, BLOCK_BYTES, cfg=CFG)

    def close(self) -> None:
        self.importer.close()
        self.peer.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kv_transfer_stress():
    total = int(os.environ.get("BATON_STRESS_TRANSFERS", "2000"))
    seconds = float(os.environ.get("BATON_STRESS_SECONDS", "0"))
    driver = Driver(total, seconds)
    try:
        driver.run()
        print("stress outcomes:", driver.outcomes)
        assert driver.started >= total
        assert driver.outcomes.get("done", 0) > total // 2
        assert driver.outcomes.get("lease_expired", 0) > 0
        end = time.monotonic() + 5
        while driver.peer.stats()[:2] != (NUM_BLOCKS - 1, 0) and time.monotonic() < end:
            time.sleep(0.02)
        print("exporter:", driver.peer.stats()[2])
        print("importer:", driver.importer.metrics())
        assert driver.peer.stats()[:2] == (NUM_BLOCKS - 1, 0), driver.peer.stats()
        assert sorted(driver.local.free) == list(range(1, NUM_BLOCKS))
        assert driver.importer.num_pending() == 0
    finally:
        driver.close()
