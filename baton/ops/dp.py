"""Data parallelism: N ranks, one scheduler each, voting on the step type over gloo.

The compiled scheduler's votes (S34/S35) call a MIN all-reduce callback; here it goes through a
`torch.distributed` gloo group on loopback (or the operator's network); torch is imported only
for a group of more than one rank (a mock engine imports none). Ranks must call the
collective the same number of times: the service loop asks `any_rank_has_work()` once per
iteration, so idle ranks keep stepping (empty prompt steps) while any rank has work.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass
class DPConfig:
    rank: int = 0
    size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    timeout_s: float = 60.0  # a rank that does not join a collective in time is dead

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"data parallel size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} not in [0, {self.size})")
        if self.size > 1 and not self.master_port:
            raise ValueError("data parallel size > 1 needs a master port")


class DPGroup:
    """A gloo process group with the two reductions the engines need."""

    def __init__(self, config: DPConfig):
        self.config = config
        self.rank, self.size = config.rank, config.size
        self._buf = None
        if config.size > 1:
            import torch
            import torch.distributed as dist

            self._buf = torch.zeros(1, dtype=torch.int64)
            dist.init_process_group(
                "gloo", init_method=f"tcp://{config.master_addr}:{config.master_port}",
                rank=config.rank, world_size=config.size,
                timeout=datetime.timedelta(seconds=config.timeout_s))
            logger.info("data parallel rank %d/%d joined via %s:%d", config.rank, config.size,
                        config.master_addr, config.master_port)

    def all_reduce_min(self, value: int) -> int:
        if self.size == 1:
            return int(value)
        import torch.distributed as dist

        self._buf.fill_(int(value))
        dist.all_reduce(self._buf, op=dist.ReduceOp.MIN)
        return int(self._buf.item())

    def any(self, flag: bool) -> bool:
        """True when any rank's flag is true (a MAX, written as a MIN of the negation)."""
        return self.all_reduce_min(0 if flag else 1) == 0

    def close(self) -> None:
        if self.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
