"""Per-pull state shared by the importer and its poller loop."""

from __future__ import annotations

import dataclasses

import msgspec

from kv_transfer import protocol as proto
from kv_transfer.errors import FailReason, TransferState
from kv_transfer.peers import Peer


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
    local_ids: list[int]
    started: float
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
