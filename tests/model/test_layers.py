"""The model's small ops against the formulas they replace (no weights needed)."""

from __future__ import annotations

import pytest
import torch

from baton.model.llama import rms_norm


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: fp32 statistics, the weight applied in the input's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bit_identical_to_the_reference(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    assert torch.equal(rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))
