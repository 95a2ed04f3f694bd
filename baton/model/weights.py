"""Helpers that copy HF-named checkpoint tensors into a model's (fused) parameters; each family
module (`llama.py`, `qwen.py`, ...) says which tensors make which parameter."""

from __future__ import annotations

import torch


class MissingWeightError(KeyError):
    """A tensor the architecture needs is absent from the checkpoint."""


def take(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in weights:
        raise MissingWeightError(name)
    return weights[name]


def copy_weight(dst: torch.nn.Parameter, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"weight {name}: shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dtype=dst.dtype, device=dst.device))
