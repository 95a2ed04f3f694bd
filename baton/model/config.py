"""The model's shape and numerics, read from a GGUF header or a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from baton.model.backends.base import AttentionOptions
from baton.model.modes import check_dtype_name

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"float32"`/`"bfloat16"`/`"float16"` (or a torch dtype) -> torch dtype; ValueError otherwise."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; expected one of {sorted(_DTYPES)}")
        return dtype
    return _DTYPES[check_dtype_name(dtype)]


def layer_windows(types: list[str], window: int | None) -> tuple[int | None, ...]:
    """config.json's `layer_types` -> `ModelConfig.layer_windows`."""
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown:
        raise ValueError(f"unsupported layer types {sorted(unknown)}")
    if "sliding_attention" in types and not window:
        raise ValueError("sliding_attention layers without a sliding_window")
    return tuple(window if t == "sliding_attention" else None for t in types)


@dataclass
class ModelConfig:
    """A decoder of one of the supported families (`baton/model/families.py`). Defaults are
    SmolLM2-135M's; the fields after `architecture` are what other families add."""

    num_layers: int = 30  # decoder blocks
    hidden_size: int = 576  # residual stream width
    intermediate_size: int = 1536  # SwiGLU inner width
    num_heads: int = 9  # query heads
    num_kv_heads: int = 3  # key/value heads (grouped-query attention when < num_heads)
    head_dim: int = 64  # per-head width; not always hidden_size // num_heads
    vocab_size: int = 49152
    rope_theta: float = 100000.0  # RoPE base (of every layer, unless layer_rope says)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True  # lm_head shares the embedding matrix
    max_position: int = 8192  # longest context the RoPE table covers
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = field(default=(2,))  # any of these ends a sequence
    dtype: torch.dtype = torch.float32  # weights and activations (norms/softmax run in fp32)
    architecture: str = "llama"
    hidden_act: str = "silu"  # the gated MLP's activation: silu | gelu_pytorch_tanh
    attention_bias: bool = False  # Q/K/V projections have a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of Q and K before RoPE (Qwen3)
    # Per layer: the sliding window (tokens a query sees, itself included), None = full
    # attention; () = every layer full.
    layer_windows: tuple[int | None, ...] = ()
    attention_scale: float | None = None  # scores multiplier; None = head_dim ** -0.5
    attn_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    final_softcap: float | None = None  # tanh soft-capping of the final logits (Gemma 2)
    num_experts: int = 0  # routed experts of a sparse MoE layer; 0 = dense MLPs only
    num_experts_per_tok: int = 0  # experts each token is routed to
    moe_intermediate_size: int = 0  # an expert's SwiGLU inner width
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum 1
    # Per layer: whether it is sparse (MoE); () = every layer sparse when num_experts > 0.
    sparse_layers: tuple[bool, ...] = ()
    # Per layer: (RoPE base, linear scaling factor: positions divided by it); () = every layer
    # (rope_theta, 1.0). Gemma 3: local and global layers have bases of their own.
    layer_rope: tuple[tuple[float, float], ...] = ()

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
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; expected silu or "
                             "gelu_pytorch_tanh")
        for name in ("layer_windows", "sparse_layers"):
            value = tuple(getattr(self, name))
            setattr(self, name, value)
            if value and len(value) != self.num_layers:
                raise ValueError(f"ModelConfig.{name} has {len(value)} entries for "
                                 f"{self.num_layers} layers")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                             f"1..num_experts={self.num_experts}")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be > 0, got {self.moe_intermediate_size}")
        self.layer_rope = tuple((float(base), float(factor)) for base, factor in self.layer_rope)
        if self.layer_rope and len(self.layer_rope) != self.num_layers:
            raise ValueError(f"ModelConfig.layer_rope has {len(self.layer_rope)} entries for "
                             f"{self.num_layers} layers")
        if any(base <= 0 or factor <= 0 for base, factor in self.layer_rope):
            raise ValueError(f"ModelConfig.layer_rope bases and factors must be > 0, got "
                             f"{self.layer_rope}")
        for i in range(self.num_layers):
            self.attention_options(i)  # validates the windows, scale and soft-cap

    def attention_options(self, layer: int) -> AttentionOptions:
        window = self.layer_windows[layer] if self.layer_windows else None
        return AttentionOptions(self.attention_scale, self.attn_softcap, window)

    def rope(self, layer: int) -> tuple[float, float]:
        """(RoPE base, linear scaling factor) of `layer`."""
        return self.layer_rope[layer] if self.layer_rope else (self.rope_theta, 1.0)

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and (self.sparse_layers[layer] if self.sparse_layers
                                         else True)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
