"""Model backends: the device-specific half of a forward (see base.py)."""

from __future__ import annotations

import torch

from baton.model.backends.base import Backend, StepBatch
from baton.model.backends.cpu import CPUBackend, PortableBackend


def get_backend(device: torch.device | str) -> Backend:
    """The backend for a device: the tuned CPU one, else plain torch ops."""
    return CPUBackend() if torch.device(device).type == "cpu" else PortableBackend()


__all__ = ["Backend", "CPUBackend", "PortableBackend", "StepBatch", "get_backend"]
