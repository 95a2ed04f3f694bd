"""How the simulated router picks an engine: any object with `choose` (`SelectionPolicy`).

`OverlapMinusLoad` scores as the router's cache-aware routing does (router/engine_pool.py,
`EnginePool.choose`): cost = kv_overlap_weight * (prompt blocks the engine lacks) + (blocks in
flight there), ties to the engine with the fewest requests in flight, then the first listed.
It stands in for the router's policy class until that class is importable without a router.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Candidate:
    """One engine of the role, as the router sees it."""

    name: str
    num_inflight: int  # requests this router has in flight there
    active_blocks: int  # blocks of those requests (a prompt engine's until its first token)
    overlap_blocks: int  # leading full blocks of this prompt the engine holds (KV events)


class SelectionPolicy(Protocol):
    def choose(self, role: str, num_prompt_blocks: int,
               candidates: Sequence[Candidate]) -> int:
        """The index in `candidates` of the engine that takes the request."""
        ...


@dataclass
class OverlapMinusLoad:
    kv_overlap_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.kv_overlap_weight >= 0:
            raise ValueError(f"kv_overlap_weight must be >= 0, got {self.kv_overlap_weight}")

    def choose(self, role: str, num_prompt_blocks: int,
               candidates: Sequence[Candidate]) -> int:
        if not candidates:
            raise ValueError(f"no {role} engine to choose from")
        w = self.kv_overlap_weight

        def score(i: int) -> tuple[float, int, int]:
            c = candidates[i]
            cost = w * (num_prompt_blocks - c.overlap_blocks) + c.active_blocks
            return cost, c.num_inflight, i

        return min(range(len(candidates)), key=score)
