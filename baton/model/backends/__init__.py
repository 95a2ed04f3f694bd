"""Model backends: the device-specific half of a forward (see base.py)."""

from __future__ import annotations

import torch

from baton.model.backends.base import PLAIN_ATTENTION, AttentionOptions, Backend, StepBatch
from baton.model.backends.cpu import CPUBackend, PortableBackend


def get_backend(device: torch.device | str, exact: bool = True,
                decode_kv: str = "rows") -> Backend:
    """The backend for a device: the tuned CPU one, else plain torch ops. `exact`: only the
    eager ops the exact mode is checked with (no fused kernels). `decode_kv`: the CPU
    backend's decode K/V source (EngineConfig.decode_kv)."""
    if torch.device(device).type != "cpu":
        return PortableBackend()
    return CPUBackend(fused_decode=not exact, decode_kv=decode_kv)


__all__ = ["PLAIN_ATTENTION", "AttentionOptions", "Backend", "CPUBackend", "PortableBackend", "StepBatch", "get_backend"]
