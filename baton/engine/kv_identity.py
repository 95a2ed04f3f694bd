"""Who computed a pool's KV blocks: the one `Fingerprint` an engine gives the hand-off's
handshake (kv_transfer) and writes beside every block it keeps on disk (baton/engine/kv_disk.py).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from baton.load_cache import weights_identity
from kv_transfer.protocol import Fingerprint


def weights_digest(model_path: str, quantization: str) -> str:
    """The identity of the weights an engine computes KV with: the load cache's identity of the
    weight files (size and blake2b of each file's first and last MiB) less their mtimes (a
    copy on another host is the same weights), and the quantization; "" without files (a
    mock runner)."""
    try:
        files = [[name, size, digest] for name, size, _mtime, digest in
                 weights_identity(model_path)]
    except OSError:
        return ""
    material = json.dumps([files, quantization]).encode()
    return hashlib.blake2b(material, digest_size=16).hexdigest()


def kv_fingerprint(model_path: str, quantization: str, kv_spec, key_seed: int) -> Fingerprint:
    """What two pools must share for their blocks to be interchangeable byte for byte."""
    return Fingerprint(model=Path(model_path).name,
                       dtype=str(kv_spec.dtype).removeprefix("torch."),
                       num_layers=kv_spec.num_layers, num_kv_heads=kv_spec.num_kv_heads,
                       head_dim=kv_spec.head_dim, block_size=kv_spec.block_size,
                       weights=weights_digest(model_path, quantization),
                       key_scheme=f"{key_seed:016x}")
