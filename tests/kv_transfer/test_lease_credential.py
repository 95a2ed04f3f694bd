"""The lease credential (kv_transfer/leases.py): only the holder of a handle's credential may
claim its blocks, once; real exporter process, real NIXL READs, CURVE side channel."""

from __future__ import annotations

import msgspec
import pytest
from kv_helpers import assert_whole
from test_kv_pull import pull

from kv_transfer import FailReason, TransferState
from kv_transfer.leases import CREDENTIAL_BYTES

pytestmark = pytest.mark.timeout(60)


def _rejected(peer, reason: FailReason) -> int:
    return peer.stats()[2].get(f"claims_rejected_{reason.value}", 0)


def test_every_lease_has_its_own_unguessable_credential(peer):
    handles = [peer.hold(f"cred-{i}", [10 + i], seed=i) for i in range(3)]
    creds = {h.credential for h in handles}
    assert len(creds) == 3 and all(len(c) == CREDENTIAL_BYTES >= 16 for c in creds)
    for h in handles:
        assert peer.call("abort", h.request_id)


def test_wrong_credential_is_refused_and_counted(peer, importer, local_pool):
    handle = peer.hold("cred-wrong", [5, 6], seed=11)
    before = _rejected(peer, FailReason.BAD_CREDENTIAL)
    for forged in (b"", bytes(16), bytes(b ^ 1 for b in handle.credential),
                   handle.credential[:8]):
        bad = msgspec.structs.replace(handle, credential=forged)
        result, _ = pull(importer, local_pool, bad, seed=11)
        assert result.state == TransferState.FAILED
        assert result.reason == FailReason.BAD_CREDENTIAL.value, result
    assert _rejected(peer, FailReason.BAD_CREDENTIAL) == before + 4
    # The forgeries took nothing: the holder of the credential still gets exact bytes.
    result, exact = pull(importer, local_pool, handle, seed=11)
    assert result.state == TransferState.DONE and exact
    assert_whole(peer, importer, local_pool)


def test_reused_credential_is_refused(peer, importer, local_pool):
    handle = peer.hold("cred-reuse", [7], seed=12)
    result, exact = pull(importer, local_pool, handle, seed=12)
    assert result.state == TransferState.DONE and exact
    assert_whole(peer, importer, local_pool)
    again, _ = pull(importer, local_pool, handle, seed=12)  # the same handle, replayed
    assert again.state == TransferState.FAILED
    assert again.reason == FailReason.ALREADY_CLAIMED.value, again
    assert _rejected(peer, FailReason.ALREADY_CLAIMED) >= 1
    assert_whole(peer, importer, local_pool)
