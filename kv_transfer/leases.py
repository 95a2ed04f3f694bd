"""The exporter's lease table: which request's blocks are kept for which reader, until when.

Pure bookkeeping with the clock passed in, so it is tested without sockets. Life of a lease:
hold -> (claim -> release | claim deadline) | lease deadline | abort. Every path that ends a
lease returns it to the caller exactly once, and the caller frees its blocks.

A lease is claimed only with its credential: 128 random bits made at hold, handed out in the
KV handle, compared in constant time, good for one claim (a second claim, even with the right
credential, is refused: the lease is claimed or over).
"""

from __future__ import annotations

import collections
import dataclasses
import hmac
import secrets

from kv_transfer.blocks import check_block_ids
from kv_transfer.errors import FailReason

# How many ended request ids are remembered to answer a late claim precisely.
_REMEMBER = 4096
CREDENTIAL_BYTES = 16  # 128 bits: unguessable within any lease's lifetime


@dataclasses.dataclass
class Lease:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    deadline: float
    claimed_by: str = ""  # importer's NIXL agent name once claimed
    is_aborted: bool = False  # aborted while claimed: freed when the reader lets go
    credential: bytes = dataclasses.field(default=b"", repr=False)  # set by hold()


class LeaseTable:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.leases: dict[str, Lease] = {}
        self._ended: collections.OrderedDict[str, FailReason] = collections.OrderedDict()
        # Leases per block: prompts that share a cached prefix (the engine's prefix cache hands
        # both the same ref-counted blocks) are leased, read and released independently.
        self._block_leases = collections.Counter[int]()
        self.counters = collections.Counter[str]()

    def hold(self, request_id: str, block_ids: list[int], num_tokens: int, deadline: float) -> Lease:
        if request_id in self.leases:
            raise ValueError(f"request {request_id!r} already holds a lease")
        ids = check_block_ids(block_ids, self.num_blocks, f"hold({request_id!r})")
        lease = Lease(request_id, ids, num_tokens, deadline,
                      credential=secrets.token_bytes(CREDENTIAL_BYTES))
        self.leases[request_id] = lease
        self._ended.pop(request_id, None)
        self._block_leases.update(ids)
        self.counters["leases_held"] += 1
        return lease

    def claim(self, request_id: str, agent: str, block_ids: list[int], deadline: float,
              now: float, credential: bytes = b"") -> tuple[FailReason | None, str]:
        lease = self.leases.get(request_id)
        if lease is None:
            reason = self._ended.get(request_id, FailReason.UNKNOWN_REQUEST)
            return reason, f"no lease for request {request_id!r} ({reason.value})"
        # Before any other answer: without the credential a peer learns nothing of the lease.
        if not hmac.compare_digest(credential, lease.credential):
            return FailReason.BAD_CREDENTIAL, f"wrong credential for the lease of {request_id!r}"
        if lease.claimed_by or lease.is_aborted:
            return FailReason.ALREADY_CLAIMED, f"request {request_id!r} already claimed"
        if lease.deadline <= now:
            return FailReason.LEASE_EXPIRED, f"lease of {request_id!r} expired"
        if block_ids != lease.block_ids:
            return FailReason.BAD_HANDLE, f"block ids do not match the lease of {request_id!r}"
        lease.claimed_by = agent
        lease.deadline = deadline
        self.counters["leases_claimed"] += 1
        return None, ""

    def release(self, request_id: str, agent: str) -> Lease | None:
        lease = self.leases.get(request_id)
        if lease is None or lease.claimed_by != agent:
            self.counters["releases_ignored"] += 1
            return None
        self.counters["leases_released"] += 1
        return self._end(lease, FailReason.ALREADY_CLAIMED)

    def abort(self, request_id: str) -> Lease | None:
        """End an unclaimed lease now; a claimed one ends when its reader lets go."""
        lease = self.leases.get(request_id)
        if lease is None or lease.is_aborted:
            return None
        self.counters["leases_aborted"] += 1
        if lease.claimed_by:
            lease.is_aborted = True
            return None
        return self._end(lease, FailReason.ABORTED)

    def expire(self, now: float) -> list[Lease]:
        ended = []
        for lease in [x for x in self.leases.values() if x.deadline <= now]:
            key = "claims_expired" if lease.claimed_by else "leases_expired"
            self.counters[key] += 1
            ended.append(self._end(lease, FailReason.LEASE_EXPIRED))
        return ended

    def num_leased_blocks(self) -> int:
        return len(self._block_leases)

    def has_claimed(self) -> bool:
        return any(x.claimed_by for x in self.leases.values())

    def _end(self, lease: Lease, reason: FailReason) -> Lease:
        del self.leases[lease.request_id]
        self._block_leases.subtract(lease.block_ids)
        self._block_leases += collections.Counter()  # drop the blocks no lease holds now
        self._ended[lease.request_id] = reason
        while len(self._ended) > _REMEMBER:
            self._ended.popitem(last=False)
        return lease
