"""The paged KV pool: one tensor, block-major, so a block is one contiguous byte range.

```
kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

 block 0 (null, never used) | block 1                                   | block 2 ...
                            | layer 0: K [block_size, kv_heads, head_dim]
                            |          V [block_size, kv_heads, head_dim]
                            | layer 1: K ...  V ...
                            | ...
                            | layer L-1: K ...  V ...
                            |<------------ bytes_per_block ------------->|
slot = block_id * block_size + offset   (offset = position % block_size)
```
One block is one NIXL descriptor, and runs of consecutive block ids merge into one transfer.
Block 0 is the scheduler's null block: block tables are padded with it, nothing is written to it.
"""

from __future__ import annotations

import logging
import mmap
from dataclasses import dataclass

import torch

from baton.model.config import ModelConfig, resolve_dtype

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the pool; the same on every engine that exchanges blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16  # tokens per block
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be > 0, got {getattr(self, name)}")

    @classmethod
    def from_model(cls, config: ModelConfig, block_size: int = 16,
                   dtype: torch.dtype | str | None = None) -> KVCacheSpec:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, block_size,
                   resolve_dtype(dtype) if dtype is not None else config.dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        numel = 1
        for dim in self.block_shape:
            numel *= dim
        return numel * torch.empty((), dtype=self.dtype).element_size()

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        """How many blocks (null block included) fit in `budget_bytes`; at least 2 or ValueError."""
        num_blocks = int(budget_bytes) // self.bytes_per_block
        if num_blocks < 2:
            raise ValueError(
                f"KV budget of {budget_bytes} bytes holds {num_blocks} blocks of "
                f"{self.bytes_per_block} bytes; need at least 2 (null block + one)"
            )
        return num_blocks

    def fingerprint(self) -> str:
        """Layout identity: two engines exchange blocks only when these are equal."""
        dtype = str(self.dtype).removeprefix("torch.")
        return (f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}"
                f"-B{self.block_size}-{dtype}")


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed pool `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
    if torch.device(device).type == "cpu":
        # Anonymous memory is zero pages from the kernel, each touched on its first write: the
        # pool costs no start-up time (torch.zeros wrote every byte of a 1 GiB pool: ~1 s).
        buf = mmap.mmap(-1, num_blocks * spec.bytes_per_block,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        kv = torch.frombuffer(buf, dtype=spec.dtype).view(num_blocks, *spec.block_shape)
    else:
        kv = torch.zeros((num_blocks, *spec.block_shape), dtype=spec.dtype, device=device)
    logger.info("KV pool: %d blocks x %d bytes = %.1f MiB on %s (%s)", num_blocks,
                spec.bytes_per_block, num_blocks * spec.bytes_per_block / 2**20, device,
                spec.fingerprint())
    return kv
