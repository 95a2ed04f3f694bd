"""Which path a request takes in a mixed fleet: co-located on a NORMAL engine, or disaggregated
(a PROMPT engine prefills, a COMPLETION engine decodes), given plain data only.

A request's path, step by step (router/engine_pool.py's `choose_path` drives it):
  1. a fleet with one kind of engine live has one path (reason `only_path`): nothing to choose;
  2. otherwise the pool asks the selection policy (router/selection.py) which NORMAL, PROMPT and
     COMPLETION engine the request would get, and describes each as an `EngineView`: its
     requests decoding, its prompt tokens queued for prefill, the context of its decodes, and
     the request's leading blocks it holds (the router's KV index);
  3. the path policy compares the two paths and returns a `PathChoice`: the path, its reason
     (the `reason` label of `baton_router_path_total`), and the predicted cost of each path.

Policies:
  predicted  (`--profile PROFILE.json`) the path whose predicted cost is lower, from the
             [sim] profile's prefill, decode and KV transfer costs (baton/perf/profile.py):
               cost = TTFT + stall + handoff + horizon * (TPOT + num_running * marginal_decode)
             TTFT: the chosen engine's current work first (co-located: the rest of the
             decode step in progress, half a step on average, and the prompts queued there;
             disaggregated: the prompts queued on the prompt engine), then the request's own
             prefill of the blocks that engine lacks (prompt and decode steps never mix:
             docs/scheduler.md S33);
             stall: co-located only: every request decoding on the normal engine waits for this
             prefill (the prefill/decode interference disaggregation exists to remove);
             handoff: disaggregated only: pulling the blocks the completion engine lacks,
             the rest of its decode step in progress, and `handoff_ms` (the extra router hop,
             the completion engine's admission, the pull's claim);
             TPOT: the decode engine's step with the request in its batch, and what the request
             adds to every other decode there, over the first `horizon` = min(max_tokens,
             DECODE_HORIZON_TOKENS) tokens.
             On an idle fleet co-located always wins (same prefill, no handoff): disaggregation
             pays when the normal engine is decoding and the prompt is long enough that its
             stall costs the running requests more than the handoff, or when the prompt engine
             holds much more of the prompt than the normal engine does.
  threshold  (`--pd-threshold-tokens N`, and the default without a profile at
             DEFAULT_THRESHOLD_TOKENS) disaggregated when the prompt tokens the normal engine
             would have to prefill (its cached prefix left out) exceed N: NVIDIA Dynamo's and
             llm-d's conditional disaggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton.perf.profile import Profile

COLOCATED = "colocated"
DISAGGREGATED = "disaggregated"
PATHS = (COLOCATED, DISAGGREGATED)

# Reasons (the `reason` label of baton_router_path_total).
ONLY_PATH = "only_path"  # one kind of engine is live (or registered): one path
PREDICTED = "predicted"  # the profile's cost model chose
THRESHOLD = "threshold"  # the --pd-threshold-tokens rule chose
DEFAULT_THRESHOLD = "default_threshold"  # no profile, no threshold: the default threshold chose
FALLBACK = "fallback"  # the request failed on the other path before any token went out

# Without a profile: Dynamo's conditional disaggregation prefills locally up to 1000 new tokens
# (its max_local_prefill_length). Lower here: on this host's CPU engines a ~1500-token prompt
# stalls co-located streams for 3-4 s (README, serving benchmark), so 512 tokens is already
# about a second of stall. A rule of thumb, not a measurement: a profile replaces it.
DEFAULT_THRESHOLD_TOKENS = 512
# The tokens of its own decode a path is charged for: enough to see a loaded decode batch, short
# enough that the choice stays about this request's prefill (the completion engines' selection
# balances the decode batches).
DECODE_HORIZON_TOKENS = 16
# The disaggregated path's fixed cost beyond the profile's KV copy: one more router -> engine
# hop, the completion engine's admission and the claim round trip of the pull. A profile's
# `path.handoff_ms` measures it (baton profile, on mock engines); this estimate for one host
# (two ZMQ hops and a step boundary) stands in for a profile without one; `--pd-handoff-ms`
# overrides both.
DEFAULT_HANDOFF_MS = 10.0


@dataclass(frozen=True)
class EngineView:
    """One engine as the path policy sees it: the engine the selection policy would pick."""

    num_running: int = 0  # requests decoding there
    num_queued_prefills: int = 0  # requests waiting there for their first token
    num_queued_tokens: int = 0  # prompt tokens those requests still have to prefill
    num_context_tokens: int = 0  # tokens the decoding requests attend to (their prompts)
    num_overlap_blocks: int = 0  # leading blocks of this request the engine holds
    block_size: int = 16


@dataclass(frozen=True)
class PathRequest:
    """What the path policy knows of the request."""

    num_prompt_tokens: int  # prompt tokens (a migration's: prompt + tokens so far)
    max_tokens: int = DECODE_HORIZON_TOKENS  # its max_tokens: bounds the decode horizon


@dataclass(frozen=True)
class PathChoice:
    path: str  # COLOCATED or DISAGGREGATED
    reason: str  # why (the metric's label)
    colocated_ms: float | None = None  # the predicted cost of each path, when one was predicted
    disaggregated_ms: float | None = None

    def describe(self) -> str:
        """For the request's log line."""
        if self.colocated_ms is None or self.disaggregated_ms is None:
            return f"{self.path} ({self.reason})"
        return (f"{self.path} ({self.reason}: co-located {self.colocated_ms:.0f} ms, "
                f"disaggregated {self.disaggregated_ms:.0f} ms)")


def _uncached_tokens(num_tokens: int, view: EngineView) -> int:
    """The prompt tokens `view`'s engine must compute: a cached prefix is skipped, but the
    last token is always computed (it yields the first output)."""
    return max(1, num_tokens - view.num_overlap_blocks * view.block_size)


class PathPolicy:
    """Chooses co-located or disaggregated for one request of a mixed fleet."""

    def choose(self, request: PathRequest, normal: EngineView, prompt: EngineView,
               completion: EngineView) -> PathChoice:
        raise NotImplementedError


class ThresholdPath(PathPolicy):
    """Disaggregated when the normal engine's uncached prompt tokens exceed the threshold."""

    def __init__(self, threshold_tokens: int, reason: str = THRESHOLD):
        if threshold_tokens < 0:
            raise ValueError(f"threshold_tokens must be >= 0, got {threshold_tokens}")
        self.threshold_tokens = threshold_tokens
        self.reason = reason

    def choose(self, request: PathRequest, normal: EngineView, prompt: EngineView,
               completion: EngineView) -> PathChoice:
        num_new = _uncached_tokens(request.num_prompt_tokens, normal)
        path = DISAGGREGATED if num_new > self.threshold_tokens else COLOCATED
        return PathChoice(path, self.reason)


def build_path_policy(profile: Profile | None, threshold_tokens: int | None = None,
                      handoff_ms: float | None = None) -> PathPolicy:
    """The mixed fleet's path policy, for the router and the simulator alike: the static
    threshold when one is given, else the profile's prediction, else the default threshold."""
    if threshold_tokens is not None:
        return ThresholdPath(threshold_tokens)
    if profile is not None:
        return PredictedPath(profile, handoff_ms)
    return ThresholdPath(DEFAULT_THRESHOLD_TOKENS, DEFAULT_THRESHOLD)


class PredictedPath(PathPolicy):
    """The path of the lower predicted cost (the module docstring's formula)."""

    def __init__(self, profile: Profile, handoff_ms: float | None = None):
        """`handoff_ms` None: the profile's measured `path.handoff_ms`, else DEFAULT_HANDOFF_MS."""
        if handoff_ms is None:
            handoff_ms = profile.path.handoff_ms if profile.path else DEFAULT_HANDOFF_MS
        if not 0 <= handoff_ms < float("inf"):
            raise ValueError(f"handoff_ms must be >= 0 and finite, got {handoff_ms}")
        self.profile = profile
        self.handoff_ms = handoff_ms

    def choose(self, request: PathRequest, normal: EngineView, prompt: EngineView,
               completion: EngineView) -> PathChoice:
        co, pd = self.colocated_ms(request, normal), self.disaggregated_ms(request, prompt,
                                                                          completion)
        return PathChoice(DISAGGREGATED if pd < co else COLOCATED, PREDICTED, co, pd)

    def ttft_ms(self, request: PathRequest, first: EngineView, path: str) -> float:
        """The request's predicted time to first token on `first`, the engine that prefills it
        (a NORMAL engine co-located; a PROMPT engine disaggregated, whose first token goes
        out from there): co-located, the rest of the decode step in progress; the prompts
        queued there; then its own prefill of the blocks that engine lacks."""
        boundary = self._step_boundary_ms(first) if path == COLOCATED else 0.0
        return boundary + self._queue_ms(first) + self._prefill_ms(
            _uncached_tokens(request.num_prompt_tokens, first), request.num_prompt_tokens)

    def colocated_ms(self, request: PathRequest, normal: EngineView) -> float:
        prefill = self._prefill_ms(_uncached_tokens(request.num_prompt_tokens, normal),
                                   request.num_prompt_tokens)
        ttft = self.ttft_ms(request, normal, COLOCATED)
        stall = normal.num_running * prefill
        return ttft + stall + self._decode_cost(request, normal)

    def disaggregated_ms(self, request: PathRequest, prompt: EngineView,
                         completion: EngineView) -> float:
        ttft = self.ttft_ms(request, prompt, DISAGGREGATED)
        num_blocks = -(-request.num_prompt_tokens // completion.block_size)
        handoff = self.handoff_ms + self._step_boundary_ms(completion) + self.profile.transfer_ms(
            num_blocks - min(num_blocks, completion.num_overlap_blocks))
        return ttft + handoff + self._decode_cost(request, completion)

    def _decode_cost(self, request: PathRequest, engine: EngineView) -> float:
        """The request's own decode steps over the horizon, and what it adds to the others'."""
        horizon = min(max(request.max_tokens, 1), DECODE_HORIZON_TOKENS)
        batch, context = engine.num_running, engine.num_context_tokens
        with_it = self._decode_ms(batch + 1, context + request.num_prompt_tokens)
        added = with_it - self._decode_ms(batch, context) if batch else 0.0
        return horizon * (with_it + batch * added)

    def _step_boundary_ms(self, engine: EngineView) -> float:
        """A busy engine takes new work at its next step: half a decode step on average."""
        return self._decode_ms(engine.num_running, engine.num_context_tokens) / 2

    def _prefill_ms(self, num_new: int, num_context: int) -> float:
        return self.profile.step_ms(True, np.array([num_new]), np.array([num_context]), 1)

    def _queue_ms(self, engine: EngineView) -> float:
        """The prompts queued on the engine, prefilled before this one (as equal prompts)."""
        n = engine.num_queued_prefills
        if not n or not engine.num_queued_tokens:
            return 0.0
        each = np.full(n, engine.num_queued_tokens / n)
        return self.profile.step_ms(True, each, each, n)

    def _decode_ms(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences attending to `context` tokens in all."""
        if batch <= 0:
            return 0.0
        return self.profile.step_ms(False, np.ones(batch), np.full(batch, context / batch), batch)
