"""The CPU backend's fused decode attention: RoPE, the K/V write and attention of every query
head, one compiled op per layer (`csrc/kernels/decode_attention.cpp`), in two forms with the same
arithmetic: `decode_attention_paged` reads and writes the block pool itself through each
sequence's block table (what the quantized modes run: no second copy of the KV, the whole KV
budget holds pool blocks), `decode_attention` the dense decode rows (`cpu_decode_rows.py`; the
reference the pool form is checked against, token for token: `CPUBackend(decode_kv="rows")`).

A decode step of SmolLM2 on two cores is bound by dispatch, not arithmetic: the eager path runs
about 25 torch calls a layer between the QKV projection and the output projection (rotation,
stack, index_put, two matmuls, softmax, views), a few microseconds each, 30 layers a step. The op
does the same work in one call with its loops vectorized for AVX2 where the CPU has it. Its
float operations are not the eager path's (another summation order, a polynomial exp), so the
exact mode (fp32, no quantization) never takes it: the backend enables it for the quantized
modes, whose gates are agreement with the exact mode and disaggregated == co-located (each
output row depends only on its own sequence, never on the batch or the thread split).

The same module holds the layer's other glue as single calls for those modes: the residual add
with the RMSNorm after it (ATen's fp32 rms_norm is a composite of about eight dispatches, ~26 us
for one 576-wide row on this machine) and SiLU(gate) * up. Both act on each row alone.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def _load() -> bool:
    try:
        import baton._decode_ops  # noqa: F401  (registers torch.ops.baton_decode)
    except ImportError as e:  # a source checkout that was never built
        logger.warning("fused decode attention unavailable (%s): the eager path runs", e)
        return False
    ops = ("rms_norm", "silu_mul", "decode_attention_paged")
    if not all(hasattr(torch.ops.baton_decode, op) for op in ops):
        logger.warning("baton._decode_ops is an older build (without one of %s): the eager "
                       "path runs; `make install` rebuilds it", ", ".join(ops))
        return False
    return True


AVAILABLE = _load()
# The KV element types the ops read and write (the KV cache dtype; float16 takes the eager path
# over dense rows).
ROW_DTYPES = (torch.float32, torch.bfloat16)


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor | None, signed_sin: torch.Tensor | None,
                     ws: torch.Tensor, layer: int, rows: torch.Tensor, positions: torch.Tensor,
                     num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """One layer's decode attention for n single-token sequences: qkv [n, (Hq + 2 Hkv) D] (the
    projection; already rotated when cos is None), cos / signed_sin [n, D]; the new K/V lands
    in `ws` [L, 2, rows, Hkv, capacity, D] (float32, or bfloat16: rounded to nearest even) at
    (layer, rows[i], positions[i]) and each sequence attends over its row's positions
    0..positions[i] in float32. Returns [n, Hq D]."""
    return torch.ops.baton_decode.decode_attention(qkv, cos, signed_sin, ws, layer, rows,
                                                   positions, num_heads, num_kv_heads)


def decode_attention_paged(qkv: torch.Tensor, cos: torch.Tensor | None,
                           signed_sin: torch.Tensor | None, pool: torch.Tensor, layer: int,
                           block_tables: torch.Tensor, positions: torch.Tensor, num_heads: int,
                           num_kv_heads: int) -> torch.Tensor:
    """`decode_attention` over the block pool [num_blocks, L, 2, B, Hkv, D] instead of dense
    rows: sequence i's token t lies in block block_tables[i, t // B] at offset t % B; the new
    K/V lands at positions[i] there and each query head attends over tokens 0..positions[i],
    block by block in token order, with the dense-row op's per-key dot product, softmax and
    value sum (the same output bits for the same keys). Every table entry up to the position
    must be a real block (not the null block 0). Returns [n, Hq D]."""
    return torch.ops.baton_decode.decode_attention_paged(
        qkv, cos, signed_sin, pool, layer, block_tables, positions, num_heads, num_kv_heads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual)) for fp32 rows x [M, H] (residual None: (x,
    rms_norm(x))): the residual add and the norm in one call, a fixed summation order a row."""
    if residual is None:
        return x, torch.ops.baton_decode.rms_norm(x, weight, eps)
    return torch.ops.baton_decode.add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate|up projection [M, 2I]: [M, I], one call."""
    return torch.ops.baton_decode.silu_mul(gate_up)
