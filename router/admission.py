"""SLO-aware admission (opt-in, `--admission-ttft-ms MS`): a request whose predicted time to
first token under the current load exceeds its TTFT SLO by more than `--admission-factor` is
answered 429 with `Retry-After` at once, instead of waiting in an engine's queue to miss its
SLO late (and to push every request behind it past theirs).

The prediction is the path policy's own (router/path.py `PredictedPath.ttft_ms`, from the
`--profile` the router already predicts paths with): on the engine the request would get (the
selection policy's pick of the path's first role), the rest of the decode step in progress
(co-located), the prompts this router has queued there, then the request's own prefill of the
blocks that engine lacks (its cached prefix left out). Only a fresh request is judged: a
migration or a fallback to the other path carries tokens already promised to the client.

`Retry-After` is the predicted excess over the SLO, rounded up to whole seconds (at least 1):
about when the queue ahead will have drained that far. Refusals are counted in
`baton_router_slo_rejections_total{path}` (and as 429 in `baton_router_requests_total`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from router.openai_protocol import APIError


class Overloaded(APIError):
    """429: the request's predicted TTFT is past what its SLO allows under the current load."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(429, message, "rate_limit_error", code="slo_overload")
        self.headers = {"Retry-After": str(retry_after_s)}


@dataclass(frozen=True)
class SloAdmission:
    ttft_slo_ms: float  # the TTFT SLO requests are admitted against
    factor: float = 2.0  # refuse past factor x the SLO

    def __post_init__(self) -> None:
        if not 0 < self.ttft_slo_ms < math.inf:
            raise ValueError(f"admission TTFT SLO must be > 0 ms and finite, got "
                             f"{self.ttft_slo_ms}")
        if not 1.0 <= self.factor < math.inf:
            raise ValueError(f"admission factor must be >= 1 and finite, got {self.factor}")

    @property
    def limit_ms(self) -> float:
        return self.ttft_slo_ms * self.factor

    def check(self, predicted_ttft_ms: float, path: str) -> None:
        """Raise `Overloaded` when `predicted_ttft_ms` is past the limit."""
        if predicted_ttft_ms <= self.limit_ms:
            return
        retry_after_s = max(1, math.ceil((predicted_ttft_ms - self.ttft_slo_ms) / 1000.0))
        raise Overloaded(
            f"Predicted time to first token {predicted_ttft_ms:.0f} ms on the {path} path is "
            f"over {self.factor:g} x the {self.ttft_slo_ms:g} ms TTFT SLO under the current "
            f"load; retry after {retry_after_s} s", retry_after_s)
