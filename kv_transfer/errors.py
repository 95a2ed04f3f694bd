"""Errors, failure reasons and the poll state of one transfer."""

from __future__ import annotations

import enum


class TransferState(enum.IntEnum):
    """Poll state of one pull, ordered: a transfer only moves forward."""

    PENDING = 0  # handshake or claim in flight
    TRANSFERRING = 1  # NIXL transfer posted
    DONE = 2
    FAILED = 3


class FailReason(str, enum.Enum):
    """Why a transfer failed; the value is what metrics and the wire carry."""

    PEER_GONE = "peer_gone"  # side channel silent or NIXL saw the peer disconnect
    PEER_RESTARTED = "peer_restarted"  # handle names an instance that no longer runs
    LEASE_EXPIRED = "lease_expired"
    ALREADY_CLAIMED = "already_claimed"
    UNKNOWN_REQUEST = "unknown_request"
    BAD_CREDENTIAL = "bad_credential"  # a claim without the lease's credential
    BAD_HANDLE = "bad_handle"  # ids, counts or sizes out of range / not matching
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    CHECKSUM_MISMATCH = "checksum_mismatch"  # a pulled block's bytes differ from the producer's
    TIMEOUT = "timeout"
    ABORTED = "aborted"
    TRANSFER_ERROR = "transfer_error"  # any other NIXL failure
    CLOSED = "closed"  # the importer was closed with the transfer pending


# The failures that mean "these bytes are not the KV they claim to be" (counted apart:
# baton_kv_integrity_failures_total).
INTEGRITY_FAILURES = (FailReason.FINGERPRINT_MISMATCH, FailReason.CHECKSUM_MISMATCH)


class KVTransferError(Exception):
    """Base of kv_transfer errors; carries the FailReason."""

    reason = FailReason.TRANSFER_ERROR

    def __init__(self, message: str, reason: FailReason | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class PeerGoneError(KVTransferError):
    """The peer process is dead or unreachable."""

    reason = FailReason.PEER_GONE


class BadHandleError(KVTransferError):
    reason = FailReason.BAD_HANDLE
