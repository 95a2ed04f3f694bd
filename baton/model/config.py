"""The model's shape and numerics, read from a GGUF header or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.model.modes import check_dtype_name

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"float32"`/`"bfloat16"`/`"float16"` (or a torch dtype) -> torch dtype; ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(_DTYPES)}")
        return dtype
    return _DTYPES[check_dtype_name(dtype)]


@dataclass
class ModelConfig:
    """A Llama-family decoder. Defaults are SmolLM2-135M's."""

    num_layers: int = 30  # decoder blocks
    hidden_size: int = 576  # residual stream width
    intermediate_size: int = 1536  # SwiGLU inner width
    num_heads: int = 9  # query heads
    num_kv_heads: int = 3  # key/value heads (grouped-query attention when < num_heads)
    head_dim: int = 64  # per-head width; not always hidden_size // num_heads
    vocab_size: int = 49152
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True  # lm_head shares the embedding matrix
    max_position: int = 8192  # longest context the RoPE table covers
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = field(default=(2,))  # any of these ends a sequence
    dtype: torch.dtype = torch.float32  # weights and activations (norms/softmax run in fp32)
    architecture: str = "llama"

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "num_heads",
                     "num_kv_heads", "head_dim", "vocab_size", "max_position"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError(
                f"rope_theta={self.rope_theta} and rms_norm_eps={self.rms_norm_eps} must be > 0"
            )
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        self.dtype = resolve_dtype(self.dtype)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
