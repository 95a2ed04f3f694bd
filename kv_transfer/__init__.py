"""KV-cache transfer between prompt and completion engines over NIXL (UCX backend).

Prompt side: KVExporter.hold() -> KVHandle. Completion side: KVImporter.start_pull(handle,
local_block_ids), then poll()/collect()/on_result. See exporter.py and importer.py.
"""

from kv_transfer.config import PoolSpec, TransferConfig
from kv_transfer.errors import (
                                BadHandleError,
                                FailReason,
                                KVTransferError,
                                PeerGoneError,
                                TransferState,
)
from kv_transfer.exporter import KVExporter
from kv_transfer.importer import KVImporter
from kv_transfer.protocol import Fingerprint, KVHandle
from kv_transfer.pulls import TransferResult

__all__ = [
    "BadHandleError", "FailReason", "Fingerprint", "KVExporter",
    "KVHandle", "KVImporter", "KVTransferError", "PeerGoneError", "PoolSpec", "TransferConfig",
    "TransferResult", "TransferState",
]
