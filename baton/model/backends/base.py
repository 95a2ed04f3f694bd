"""What a model backend provides: the device-specific half of a forward.

The model files (`baton/model/layers.py` and one module per family) hold only the math; everything that depends on
the device or on a kernel library goes through a `Backend`:

* `linear` / `lm_head`: the GEMMs (the CPU backend threads few-row GEMMs itself);
* `prepare`: per-step attention metadata from the scheduler's flat batch, built once and shared
  by every layer (slots, decode rows, prefill masks, which tokens reach the LM head);
* `attention`: write one layer's new K/V into the paged pool and attend over it, with the
  layer's `AttentionOptions` (scale, soft-capping, sliding window);
* `fused_attention`: the same with RoPE included, as one kernel, where the backend has one for
  the step (the CPU backend's decode steps of the quantized modes);
* `fused_norm` / `fused_silu_mul`: a layer's glue (residual add + RMSNorm, SiLU * up) as one
  kernel each, where the backend has them (the CPU backend's quantized modes);
* `finish_step`: whatever state the backend keeps across steps learns that the step ran;
* `set_model` / `kv_memory_factor`: told the model's attention options and dtypes once, the
  backend says how many bytes it keeps beside the pool per pool byte, so the engine's memory
  budget covers both: 0 where decode attention reads the pool itself (the CPU backend's
  quantized modes on a plain-attention model with `decode_kv="pool"`), 1 where it mirrors each
  decoding sequence's K/V in dense rows (the default; always in the exact mode, the quality
  reference, and for models with attention options).

A CUDA backend (flash attention over the paged pool, no dense rows) goes beside `cpu.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer's attention differs from plain causal softmax(q k^T / sqrt(D)) v."""

    scale: float | None = None  # scores multiplier; None = head_dim ** -0.5
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2)
    window: int | None = None  # sliding window: key j visible to query i iff i - j < window

    def __post_init__(self) -> None:
        if self.scale is not None and self.scale <= 0:
            raise ValueError(f"AttentionOptions.scale must be > 0, got {self.scale}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"AttentionOptions.softcap must be > 0, got {self.softcap}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"AttentionOptions.window must be >= 1, got {self.window}")

    @property
    def is_plain(self) -> bool:
        return self.scale is None and self.softcap is None and self.window is None


PLAIN_ATTENTION = AttentionOptions()


@dataclass
class StepBatch:
    """One scheduler step as tensors on the model's device (built by the model runner)."""

    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # int64 [n, max_blocks], padded with the null block 0
    seqlens_q: np.ndarray  # int64 [n] new tokens of each sequence
    seqlens_k: np.ndarray  # int64 [n] context length of each sequence after this step
    seq_ids: np.ndarray | None  # int64 [n] the scheduler's ids; None = no identity across steps
    # Every token is a decode token: a speculative decode step's rows run 1 + k tokens (the
    # last committed one, then drafts), whose GEMMs must be a plain decode token's.
    decode_step: bool = False


class Backend(Protocol):
    """The device-specific operations a model forward runs through."""

    name: str
    kv_memory_factor: float  # bytes kept beside the pool per pool byte (after set_model)

    def set_model(self, options: Sequence[AttentionOptions], dtype: torch.dtype,
                  kv_dtype: torch.dtype) -> None:
        """The model it serves: each layer's attention options, the compute dtype and the KV
        pool's; sets `kv_memory_factor` (called before the pool is sized)."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor: ...

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """The vocabulary projection of x, the step's flat tokens `rows` (None = all of them)."""

    def prepare(self, batch: StepBatch, kv_cache: torch.Tensor, dtype: torch.dtype) -> Any:
        """Attention metadata for this step; passed back to `attention` and `finish_step`."""

    def last_tokens(self, meta: Any) -> torch.Tensor | None:
        """Flat index of each sequence's last token (the LM head's rows); None = every token."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  layer_kv: torch.Tensor, meta: Any, layer: int,
                  options: AttentionOptions = PLAIN_ATTENTION) -> torch.Tensor:
        """Store k, v [T, Hkv, D] at their slots of `layer_kv` [num_blocks, 2, block_size, Hkv,
        D] and return attention of q [T, Hq, D] over each sequence's context: [T, Hq, D],
        with the layer's `options` (scale, soft-capping, sliding window)."""

    def fused_attention(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                        meta: Any, layer: int) -> torch.Tensor | None:
        """RoPE, the K/V write and attention of a whole step in one kernel, from the fused QKV
        projection [T, (Hq + 2 Hkv) D] and the rotation [T, 1, D]: [T, Hq D]; None = this step
        takes `attention` (the model applies RoPE itself). Plain attention only: a layer with
        `AttentionOptions` other than the defaults never calls it."""

    def fused_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(x + residual, RMSNorm of it) as one kernel (residual None: (x, RMSNorm(x))); None
        = the model runs its own ops."""

    def fused_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up of the fused projection [T, 2I] as one kernel: [T, I]; None = the
        model runs its own ops."""

    def finish_step(self, meta: Any) -> None: ...
