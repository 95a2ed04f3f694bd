"""Fixtures: one exporter process per module, one in-process importer per module."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.update({"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"})

import kv_peer  # noqa: E402
from kv_helpers import BLOCK_BYTES, FAST, NUM_BLOCKS, LocalPool  # noqa: E402

from kv_transfer import KVImporter, TransferConfig  # noqa: E402


@pytest.fixture(scope="module")
def peer():
    p = kv_peer.PeerProcess(NUM_BLOCKS, BLOCK_BYTES, cfg=FAST)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def local_pool():
    return LocalPool()


@pytest.fixture(scope="module")
def importer(local_pool):
    imp = KVImporter(local_pool.data, TransferConfig(**FAST), kv_peer.fingerprint())
    yield imp
    imp.close()
