"""A fleet in virtual time: real `LLMEngine`s over the model-free runner, one event queue.

A request's life in the simulator:
1. It arrives at its workload time (a trace's timestamp, a Poisson draw, or, for a later turn of
   a conversation, the end of the turn before). In a mixed fleet (normal engines beside prompt
   and completion ones) the router's own path policy (router/path.py, the class the router
   runs) first chooses its path, co-located or disaggregated, from the engine of each role the
   selection policy would give it and the router's books of the work there (counted per path
   and reason, as `baton_router_path_total`). The router's own selection policy
   (router/selection.py, the class the router runs) picks an engine of the path's first role
   (normal, or prompt) from candidates carrying each engine's load and active blocks, over a
   `KeySets` view of the keys each engine's KV events reported; `add_request` queues it.
2. An engine with work steps: `LLMEngine.step()` runs the real scheduler and the mock runner,
   which reports the profile's predicted step time; the step's outputs land that much later,
   when the engine may step again. Arrivals in between wait in `waiting`, as on a real engine.
3. NORMAL: the first output is the first token (TTFT), the last one ends the request.
   PROMPT: the prompt's output carries the first token and the handed-off blocks; the policy
   picks a completion engine, which allocates through `add_prompted_request` (the pinned run of
   its own cache by the prompt engine's `block_keys`), LATER retrying whenever one of its steps
   ends. The pull takes the profile's transfer time for the blocks not cached, after the pull
   admitted before it on the same completion engine (one link: a real engine's importer
   verifies each landed pull in turn on one thread, and its reads share the host's or the
   NIC's bandwidth); then `commit_prompted` there and `release_handed_off` on the prompt
   engine (the lease ends).
4. At the end every engine must be drained: free blocks == total blocks (checked).
Engines that share a host (`FleetConfig.engines_per_host`) slow each other's steps by the
profile's `contention`: a step runs at 1/slowdown of its speed while other engines of its host
run steps of the other kind (baton/perf/profile.py `Contention.slowdown`), and its end moves
whenever one of them starts or ends a step (processor sharing in virtual time). Where the
router and the clients share the first host (`FleetConfig.service_cores`), their CPU for each
step's outputs lengthens that host's busy engines' steps once it has no idle core.
Nothing here reaches into an engine's parts: only the engine's verbs, counters and KV events.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from baton.engine import AllocStatus, EngineConfig, LLMEngine
from baton.engine.config import SERVE_MAX_NUM_BATCHED_TOKENS
from baton.perf.mock_runner import MockRunner
from baton.perf.profile import Profile
from baton.protocol import COMPLETION, NORMAL, PROMPT, EngineStats
from baton.sampling.params import SamplingParams
from baton.workload.results import RequestResult
from baton.workload.synthetic import RequestSpec
from router.kv_index import RequestKeys
from router.load import EngineWork, LegWork
from router.metrics import Outcome
from router.path import (
    COLOCATED,
    DISAGGREGATED,
    ONLY_PATH,
    EngineView,
    PathPolicy,
    PathRequest,
    build_path_policy,
)
from router.prepare_pool import INLINE_BYTES
from router.selection import Candidate, KeySets, SelectionPolicy

logger = logging.getLogger(__name__)


@dataclass
class FleetConfig:
    num_normal: int = 1  # co-located engines
    num_prompt: int = 0  # prompt engines (with completion engines: disaggregated)
    num_completion: int = 0
    num_blocks: int = 0  # KV blocks per engine, null block included; 0 = the profiled engine's
    max_num_seqs: int = 64
    # `baton engine`'s default, so an unconfigured simulated fleet (the live planner's in
    # `baton up`, `baton planner`'s) is the one `baton up` starts.
    max_num_batched_tokens: int = SERVE_MAX_NUM_BATCHED_TOKENS
    enable_prefix_caching: bool = True
    # The router's prepare workers (`baton router --prepare-workers`, its default): a body over
    # router/prepare_pool.py's INLINE_BYTES is prepared there, a smaller one on its event loop.
    num_prepare_workers: int = 2
    # Engines a host holds: the fleet's engines fill hosts in order (normal, then prompt, then
    # completion ones), and engines of one host slow each other's steps by the profile's
    # `contention` (a profile without it is refused for more than 1). 1: each engine on its own
    # host (its own GPU, its own cores), as a fleet is deployed; `baton up` on one machine puts
    # all its engines on one host.
    engines_per_host: int = 1
    # Where the router and the clients run. 0: elsewhere, on machines of their own. N: on the
    # first host (its engines as above), a machine of N cores, one per engine and the rest
    # idle: their CPU for each step's outputs (the profile's `path.service_step_ms` and
    # `service_token_ms`) runs on an idle core while the host has one, else it is taken from
    # the host's busy engines in equal parts, each one's step that much longer. `baton up` and
    # a benchmark's client on one machine (bench/sim_validate.py: this machine's cores).
    service_cores: int = 0

    def __post_init__(self) -> None:
        for name in ("num_normal", "num_prompt", "num_completion", "num_blocks",
                     "num_prepare_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.engines_per_host < 1:
            raise ValueError(f"engines_per_host must be >= 1, got {self.engines_per_host}")
        first_host = min(self.engines_per_host,
                         self.num_normal + self.num_prompt + self.num_completion)
        if self.service_cores and self.service_cores < first_host:
            raise ValueError(f"service_cores must be 0 (the router and the clients elsewhere) "
                             f"or at least the first host's {first_host} engines (a core each), "
                             f"got {self.service_cores}")
        if (self.num_prompt > 0) != (self.num_completion > 0):
            raise ValueError(f"a disaggregated fleet needs prompt and completion engines, got "
                             f"{self.num_prompt} prompt and {self.num_completion} completion")
        if not self.num_normal and not self.num_prompt:
            raise ValueError("the fleet has no engine")
        if self.num_blocks == 1:
            raise ValueError("num_blocks must be 0 (the profile's) or >= 2, got 1")

    @property
    def is_disaggregated(self) -> bool:
        return self.num_prompt > 0

    @property
    def is_mixed(self) -> bool:
        """Normal engines beside prompt and completion ones: each request has two paths."""
        return self.num_normal > 0 and self.num_prompt > 0


class SimEngine:
    """One engine: the real engine core, its predicted step times and its published keys."""

    def __init__(self, sim: Simulation, name: str, role: str) -> None:
        self.sim, self.name, self.role = sim, name, role
        cfg = sim.config
        self.runner = MockRunner(sim.profile, cfg.num_blocks, on_step=self._on_step,
                                 structured=self._structured)
        self.keys: set[int] = set()  # what its KV events said it holds
        self._build(role)
        self.busy = False
        self._step_s = 0.0
        self.num_empty_in_row = 0  # steps in a row that ran nothing
        self.num_inflight = 0  # the router's books: its requests in flight here (the load)
        self.active_blocks = 0  # and the blocks they add (Choice.num_active_blocks)
        self.work = EngineWork()  # and what they ask of it (router/load.py), for the path view
        self.admissions: deque[Handoff] = deque()  # COMPLETION: waiting for blocks (LATER)
        self.num_pulled_blocks = 0
        self.link_free_s = 0.0  # COMPLETION: when the pulls admitted so far are all in
        self.draining_to = ""  # a role change (S41) in progress: the role it becomes
        # Its host's other engines (FleetConfig.engines_per_host; none: nothing slows it), and
        # its step in flight: whether a prompt step (None: not stepping), its outputs, the time
        # it still needs at full speed as of `_since`, its slowdown since then, the number of
        # the end now due (a moved end voids the one before), when it began, its full time.
        self.host_peers: list[SimEngine] = []
        self.stepping: bool | None = None
        self._outputs: list = []
        self._left_s = self._since = self._began = self._full_s = 0.0
        self._slow = 1.0
        self._slowed = False  # whether its step in flight ran slowed at any time
        self._rows = 0
        self._end_no = 0
        self._free_at = 0.0  # when the loop's own work after its last step is done
        self.contended_s = 0.0  # what its peers' steps added to its own (busy time)
        self.contended_prefill_s = 0.0  # of which to its prompt steps
        # The router's and the clients' CPU taken from its steps (FleetConfig.service_cores):
        # from its step in flight so far, and owed to its next one (taken between two steps).
        self._stolen_s = 0.0
        self._owed_s = 0.0

    def _build(self, role: str) -> None:
        """The engine core in `role`'s mode over this engine's runner (S41)."""
        cfg = self.sim.config
        self.engine = LLMEngine(EngineConfig(
            engine_type=role, block_size=self.sim.profile.model.block_size,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            enable_prefix_caching=cfg.enable_prefix_caching, num_threads=1),
            runner=self.runner)
        self.events = self.engine.kv_event_source()
        self.events.scheduler.set_kv_event_capacity(4 * self.events.num_total_blocks)
        self.keys.clear()  # in place: the policy's KeySets holds this set

    def is_empty(self) -> bool:
        e = self.engine
        return (not e.has_unfinished() and e.num_free_blocks() == e.num_total_blocks()
                and self.num_inflight == 0 and not self.admissions and not self.busy)

    def stats(self) -> EngineStats:
        """This engine's stats as a live engine answers a probe (baton/service/engine_service.py
        `stats`): its queues (a completion engine's hand-offs waiting for blocks count as
        waiting), its pool, its steps and its busy seconds (the profile's step times)."""
        counts = self.engine.stats()
        return EngineStats(self.name, self.role, num_free_blocks=int(counts["num_free_blocks"]),
                           num_total_blocks=int(counts["num_total_blocks"]),
                           num_running=int(counts["num_running"]),
                           num_waiting=int(counts["num_waiting"]) + len(self.admissions),
                           num_steps=self.runner.num_steps, draining=bool(self.draining_to),
                           extra={"busy_s": self.busy_s, "uptime_s": self.sim.now})

    @property
    def busy_s(self) -> float:
        """Its steps' time: the profile's, and what its host's other engines added."""
        return self.runner.busy_s + self.contended_s

    @property
    def prefill_busy_s(self) -> float:
        return self.runner.prefill_busy_s + self.contended_prefill_s

    def start_change(self, role: str) -> None:
        """S41: no new work from now on; the switch happens once it is empty."""
        self.draining_to = role
        self.kick()

    def _structured(self, seq_id: int) -> bool:
        """Whether the request of this sequence asked for structured output (its sampled rows
        cost `grammar_row_ms` more)."""
        flight = self.sim.flights.get(self.engine.requests.by_seq(seq_id).request_id)
        return flight is not None and flight.spec.structured

    def _on_step(self, seconds: float) -> None:
        self._step_s += seconds

    def kick(self) -> None:
        """Something may have given it work: step unless a step is running, and not before the
        engine loop's own work after its last step is done (the profile's `path.step_gap_ms`:
        that step's outputs sent, what came meanwhile taken in; an idle engine given work steps
        at once). A draining engine that has become empty switches its role."""
        if not self.busy and self.engine.has_unfinished():
            self.busy, self.num_empty_in_row = True, 0
            self.sim.at(max(self.sim.now, self._free_at), self._step)
        elif self.draining_to and self.is_empty():
            self.sim.switched(self)

    def _step(self) -> None:
        self._step_s = 0.0
        outputs = self.engine.step()
        self._drain_keys()
        if self._step_s == 0.0 and not outputs:
            # Nothing ran. The engine loop steps again at once while it has work, and a step
            # can change what the next one schedules (a decode step of no sequence after the
            # last one finished, then the waiting prompt): one more step, then idle until an
            # event (an arrival, freed blocks elsewhere) kicks it.
            self.num_empty_in_row += 1
            if self.num_empty_in_row < 2 and self.engine.has_unfinished():
                self.sim.at(self.sim.now, self._step)
            else:
                # Idle: the router's and the clients' CPU it owed ran on its idle core.
                self.busy, self._owed_s = False, 0.0
                if self.draining_to and self.is_empty():  # its last request ended the step
                    self.sim.switched(self)  # before: S41's switch waits for no event
            return
        self.num_empty_in_row = 0
        self.stepping, self._outputs = self.runner.last_prompt_run, outputs
        self._rows = self.runner.last_num_rows
        self._left_s = self._full_s = self._step_s
        self._began = self._since = self.sim.now
        self._slow, self._slowed = 0.0, False  # unset: `_set_speed` schedules the end
        self._stolen_s, self._owed_s = self._owed_s, 0.0
        self._left_s += self._stolen_s  # before its end is first scheduled
        self._set_speed()
        for peer in self.host_peers:
            peer._set_speed()

    def _set_speed(self) -> None:
        """Its step's end at the speed its host's other steps leave it now (none stepping or no
        peers: full speed); moved only when that speed changed."""
        if self.stepping is None:
            return
        others = [p.stepping for p in self.host_peers if p.stepping is not None]
        slow = (self.sim.profile.contention.slowdown(self.stepping, self._rows, others)
                if others else 1.0)
        if slow == self._slow:
            return
        self._slowed = self._slowed or slow != 1.0
        self._move_end(slow)

    def steal(self, seconds: float) -> None:
        """`seconds` of its core taken by the router and the clients now: its step in flight
        ends that much later, or (busy between two steps) its next one does."""
        if self.stepping is None:
            self._owed_s += seconds
            return
        self._stolen_s += seconds
        self._move_end(self._slow, seconds)

    def _move_end(self, slow: float, extra_s: float = 0.0) -> None:
        """Its step in flight from now on at 1/`slow` of its speed, `extra_s` of wall time
        longer: the time it still needs (at full speed) brought up to now, its end scheduled
        again (the one due before is void)."""
        now = self.sim.now
        if self._slow:  # (0 before the step's first speed is set)
            self._left_s = max(0.0, self._left_s - (now - self._since) / self._slow)
        self._left_s += extra_s / slow
        self._slow, self._since = slow, now
        self._end_no += 1
        self.sim.at(now + self._left_s * slow, self._deliver, self._end_no)

    def _deliver(self, end_no: int) -> None:
        if end_no != self._end_no:
            return  # its end moved since this one was due
        outputs, self._outputs = self._outputs, []
        # What its peers' steps and the service added to the step counts as busy time, as a
        # live engine's step takes it; else exactly the profile's (no rounding of the clock).
        if self._slowed or self._stolen_s:
            extra = self.sim.now - self._began - self._full_s
            self.contended_s += extra
            if self.stepping:
                self.contended_prefill_s += extra
        self.stepping = None
        for peer in self.host_peers:
            peer._set_speed()
        self._free_at = self.sim.now + self.sim.step_gap_s
        self.busy = False
        for out in outputs:
            self.sim.on_output(self, out)
        if self.admissions:
            self.sim.retry_admissions(self)
        self.kick()
        self.sim.serve_outputs(sum(len(out.new_token_ids) for out in outputs))

    def _drain_keys(self) -> None:
        ok, stored, removed = self.events.scheduler.drain_kv_events()
        if not ok:  # the log overflowed: a snapshot, as a subscriber would get
            self.keys.clear()  # in place: the policy's KeySets holds this set
            self.keys.update(int(k) for k in self.events.scheduler.prefix_cache_keys())
            return
        self.keys.difference_update(int(k) for k in removed)
        self.keys.update(int(k) for k in stored)

    def candidate(self) -> Candidate:
        """This engine as the router's policy sees it."""
        return Candidate(self.name, float(self.num_inflight), self.active_blocks,
                         self.sim.block_size)

    def add_work(self, work: LegWork, sign: int) -> None:
        """The router's books (router/load.py `LoadTracker._add_work`): one leg in or out."""
        if work.num_prefill_tokens:
            self.work.num_prefilling += sign
            self.work.num_prefill_tokens += sign * work.num_prefill_tokens
        self.work.num_context_tokens += sign * work.num_context_tokens

    def view(self, num_overlap_blocks: int) -> EngineView:
        """This engine as the router's path policy sees it (router/engine_pool.py `_view`):
        its requests decoding, the prompts queued, their context, the request's cached blocks."""
        return EngineView(num_running=self.num_inflight - self.work.num_prefilling,
                          num_queued_prefills=self.work.num_prefilling,
                          num_queued_tokens=self.work.num_prefill_tokens,
                          num_context_tokens=self.work.num_context_tokens,
                          num_overlap_blocks=num_overlap_blocks, block_size=self.sim.block_size)


@dataclass
class Flight:
    """One request on its way through the fleet."""

    spec: RequestSpec
    token_ids: list[int]
    result: RequestResult
    arrival_s: float
    keys: RequestKeys  # its prompt's block keys, as the router computes them
    engine: SimEngine | None = None  # where it is now (the router's books)
    charged: int = 0  # active blocks charged to `engine`
    work: LegWork = field(default_factory=LegWork)  # and the work charged there
    last_token_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)


@dataclass
class Handoff:
    flight: Flight
    prompt: SimEngine
    first_token: int
    block_keys: list[int]


class Simulation:
    """The fleet and its event queue. `make_policy` builds the router's selection policy over
    the fleet's cache view (e.g. `lambda cache: OverlapMinusLoad(cache, 1.0)`)."""

    def __init__(self, profile: Profile, config: FleetConfig,
                 make_policy: Callable[[KeySets], SelectionPolicy],
                 on_done: Callable[[Flight], None] | None = None, planner=None,
                 path_policy: PathPolicy | None = None) -> None:
        """`path_policy`: a mixed fleet's (router/path.py); default the profile's prediction,
        as the router's with `--profile`."""
        self.profile, self.config = profile, config
        self.now = 0.0
        self._queue: list = []
        self._seq = itertools.count()
        self.on_done = on_done
        roles = [(NORMAL, config.num_normal), (PROMPT, config.num_prompt),
                 (COMPLETION, config.num_completion)]
        self.engines = {role: [SimEngine(self, f"{role}-{i}", role) for i in range(n)]
                        for role, n in roles if n}
        self.path_policy = path_policy or build_path_policy(profile)
        self.path_counts: dict[tuple[str, str], int] = {}  # (path, reason) -> requests
        self.kind_paths: dict[str, dict[str, int]] = {}  # request kind -> path -> requests
        self._by_name = {e.name: e for es in self.engines.values() for e in es}
        if config.engines_per_host > 1:
            if profile.contention is None:
                raise ValueError("engines sharing a host (engines_per_host > 1) need a profile "
                                 "with `contention` (measured by `baton profile`)")
            fleet = list(self._by_name.values())
            for i in range(0, len(fleet), config.engines_per_host):
                host = fleet[i:i + config.engines_per_host]
                for e in host:
                    e.host_peers = [p for p in host if p is not e]
        # The engines that share their host's cores with the router and the clients.
        if config.service_cores and profile.service_cpu_ms(1) <= 0.0:
            raise ValueError("the router and the clients on the engines' cores (service_cores) "
                             "need a profile with their CPU measured (path.service_step_ms, "
                             "service_token_ms: `baton profile`)")
        self.service_host = list(self._by_name.values())[:config.engines_per_host] \
            if config.service_cores else []
        first = self.engines.get(NORMAL) or self.engines[PROMPT]
        self.block_size = profile.model.block_size
        self.step_gap_s = profile.step_gap_ms() / 1e3
        self.key_seed = first[0].engine.prefix_cache_seed
        # What the router's KV index would hold: each engine's keys as its events reported.
        self.cache = KeySets({e.name: e.keys for es in self.engines.values() for e in es},
                             self.block_size, self.key_seed)
        self.policy = make_policy(self.cache)
        self.flights: dict[str, Flight] = {}
        self.num_handoffs_failed = 0
        # When the router's event loop and each prepare worker are free (`_prepared_at`).
        self._loop_free_s = 0.0
        self._workers_free_s = [0.0] * config.num_prepare_workers
        # The planner (planner/core.py), deciding every interval on the arrivals it saw, the
        # engines' stats and what the requests met (their outcomes, as the router records).
        self.planner = planner
        self.observations: list = []
        self.outcomes: list[Outcome] = []
        self.roles_over_time: list[dict] = []
        self.decisions: list[dict] = []
        if planner is not None:
            if not config.is_disaggregated or config.num_normal:
                raise ValueError("the planner moves engines between prompt and completion: "
                                 "start it on a prompt/completion fleet (no normal engines)")
            self._note_roles()
            self._next_decision_s = planner.config.interval_s
            self.at(self._next_tick(0.0), self._plan)

    # ------------------------------------------------------------------ the planner
    def _counts(self) -> dict[str, int]:
        return {role: len(self.engines.get(role, [])) for role in (PROMPT, COMPLETION)}

    def _note_roles(self) -> None:
        draining = sum(bool(e.draining_to) for es in self.engines.values() for e in es)
        self.roles_over_time.append({"t": self.now, **self._counts(), "draining": draining})

    def _next_tick(self, now: float) -> float:
        """The planner's next tick: its next decision, or sooner its next SLO check."""
        check_s = self.planner.config.slo_check_s
        return min(self._next_decision_s, now + check_s) if check_s else self._next_decision_s

    def _plan(self) -> None:
        """One tick of the planner (planner/core.py, given by duck type: the simulator imports
        no planner code, the planner imports the simulator): a decision every interval, and
        one between when an SLO check finds a miss that began since the last (`due`)."""
        if not (self._queue or self.flights):
            return  # the run is over: no more decisions
        is_periodic = self.now >= self._next_decision_s
        if is_periodic:
            self._next_decision_s += self.planner.config.interval_s
        self.at(self._next_tick(self.now), self._plan)
        if any(e.draining_to for es in self.engines.values() for e in es):
            return  # a change is still draining: decide on the fleet it makes
        if not is_periodic and not self.planner.due(self.now, self.outcomes):
            return
        counts = self._counts()
        current = (counts[PROMPT], counts[COMPLETION])
        engines = [e.stats() for es in self.engines.values() for e in es]
        decision = self.planner.decide(self.now, current, self.observations, engines,
                                       self.outcomes)
        self.decisions.append({"t": self.now, "action": decision.action,
                               "target": decision.target.name, "reason": decision.reason,
                               "engines": decision.engines, "slo": decision.slo})
        if decision.action != "change":
            return
        logger.info("planner at %.0f s: %dP:%dD -> %s (%s)", self.now, *current,
                    decision.target.name, decision.reason)
        move = decision.target.num_prompt - current[0]
        src, dst = (COMPLETION, PROMPT) if move > 0 else (PROMPT, COMPLETION)
        for engine in sorted(self.engines[src], key=lambda e: e.num_inflight)[:abs(move)]:
            engine.start_change(dst)
        self._note_roles()

    def switched(self, engine: SimEngine) -> None:
        """`engine` drained: it becomes its new role (S41) and takes work at once."""
        old, new = engine.role, engine.draining_to
        self.engines[old].remove(engine)
        engine._build(new)
        engine.role, engine.draining_to = new, ""
        self.engines.setdefault(new, []).append(engine)
        self._note_roles()
        for comp in self.engines.get(COMPLETION, []):
            if comp.admissions:
                self.retry_admissions(comp)

    # ------------------------------------------------------------------ the event queue
    def at(self, t: float, fn: Callable, *args) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn, args))

    def run(self) -> None:
        while self._queue:
            t, _, fn, args = heapq.heappop(self._queue)
            if fn == self._plan and not (self._queue or self.flights):
                break  # only the planner's next tick is left: the run ended before it
            self.now = t
            fn(*args)

    # ------------------------------------------------------------------ routing
    def _select(self, role: str, flight: Flight):
        """The engine of `role` the router's selection policy gives the request, and its
        choice. A draining engine (a role change) gets nothing new while another can take it."""
        engines = [e for e in self.engines[role] if not e.draining_to] or self.engines[role]
        choice = self.policy.select(role, [e.candidate() for e in engines], flight.keys)
        return self._by_name[choice.engine_id], choice

    def _choose(self, role: str, flight: Flight) -> SimEngine:
        engine, choice = self._select(role, flight)
        # The router's books of the leg (router/dispatch.py `_send`): what it prefills there,
        # the tokens past its cached prefix (the last one always), and what it attends to.
        num_tokens = len(flight.token_ids)
        num_prefill = 0 if role == COMPLETION else max(
            1, num_tokens - choice.num_overlap_blocks * self.block_size)
        self._charge(flight, engine, choice.num_active_blocks, LegWork(num_prefill, num_tokens))
        return engine

    def _choose_path(self, flight: Flight) -> str:
        """The request's path (router/engine_pool.py `choose_path`), counted: with one kind of
        engine there is one path; in a mixed fleet the path policy chooses."""
        if not self.config.is_mixed:
            choice_path = DISAGGREGATED if self.config.is_disaggregated else COLOCATED
            reason = ONLY_PATH
        else:
            views = []
            for role in (NORMAL, PROMPT, COMPLETION):
                engine, choice = self._select(role, flight)
                views.append(engine.view(choice.num_overlap_blocks))
            choice = self.path_policy.choose(
                PathRequest(len(flight.token_ids), flight.spec.max_tokens), *views)
            choice_path, reason = choice.path, choice.reason
        key = (choice_path, reason)
        self.path_counts[key] = self.path_counts.get(key, 0) + 1
        by_path = self.kind_paths.setdefault(flight.spec.kind, {})
        by_path[choice_path] = by_path.get(choice_path, 0) + 1
        return choice_path

    def _charge(self, flight: Flight, engine: SimEngine, blocks: int, work: LegWork) -> None:
        self._uncharge(flight)
        flight.engine, flight.charged, flight.work = engine, blocks, work
        engine.num_inflight += 1
        engine.active_blocks += blocks
        engine.add_work(work, +1)

    def _prefilled(self, flight: Flight) -> None:
        """Its first token is out: it leaves its engine's prefill queue (router/load.py)."""
        if flight.engine is not None and flight.work.num_prefill_tokens:
            flight.engine.add_work(LegWork(flight.work.num_prefill_tokens), -1)
            flight.work.num_prefill_tokens = 0

    def _uncharge(self, flight: Flight) -> None:
        if flight.engine is not None:
            flight.engine.num_inflight -= 1
            flight.engine.active_blocks -= flight.charged
            flight.engine.add_work(flight.work, -1)
            flight.engine, flight.charged, flight.work = None, 0, LegWork()

    # ------------------------------------------------------------------ requests
    def submit(self, spec: RequestSpec, token_ids: list[int], t: float) -> None:
        """`spec` arrives at the router at virtual time `t` with these prompt tokens; the
        engines see it once the router has prepared it and it has crossed the serving path (the
        profile's `path.request_ms`: the router's HTTP and routing work and the wires, measured
        on mock engines; its way back to the client is charged here too)."""
        seen_at = (self._prepared_at(spec, len(token_ids), t)
                   + self.profile.request_path_ms() / 1e3)
        self.at(seen_at, self._arrive, spec, token_ids, t)

    def _prepared_at(self, spec: RequestSpec, num_tokens: int, t: float) -> float:
        """When the router has prepared a request that arrived at `t` (the profile's prepare
        cost; at once without one): a body of at most INLINE_BYTES on its event loop, one after
        another, a larger one on the first free prepare worker (router/prepare_pool.py). A
        burst's short prompts thus reach the engines before its long ones, as they do live."""
        cost_s = self.profile.prepare_ms(num_tokens) / 1e3
        if cost_s <= 0:
            return t
        # The body's size: the spec's text per word (one simulated token a word), times the
        # prompt's tokens (a later turn's prompt is the whole conversation so far).
        num_bytes = len(spec.text.encode()) * num_tokens / max(1, len(spec.text.split()))
        if num_bytes <= INLINE_BYTES or not self._workers_free_s:
            self._loop_free_s = max(t, self._loop_free_s) + cost_s
            return self._loop_free_s
        free = self._workers_free_s
        i = min(range(len(free)), key=free.__getitem__)
        free[i] = max(t, free[i]) + cost_s
        return free[i]

    def serve_outputs(self, num_tokens: int) -> None:
        """The router's and the clients' CPU for one step's `num_tokens` outputs, where they
        share the first host (FleetConfig.service_cores): on an idle core of it, else taken
        from its busy engines in equal parts (whichever engine's outputs they are: the router
        serves them all)."""
        if not self.service_host:
            return
        cost_s = self.profile.service_cpu_ms(num_tokens) / 1e3
        busy = [e for e in self.service_host if e.busy]
        if cost_s <= 0.0 or len(busy) < self.config.service_cores:
            return
        for e in busy:
            e.steal(cost_s / len(busy))

    def _arrive(self, spec: RequestSpec, token_ids: list[int], arrival_s: float) -> None:
        if self.planner is not None:  # (arrival, prompt tokens, output tokens), in order
            self.observations.append((self.now, len(token_ids), spec.max_tokens))
        res = RequestResult(spec.idx, spec.kind, prompt_tokens=len(token_ids),
                            expected_output_tokens=spec.max_tokens, start_s=arrival_s)
        flight = Flight(spec, token_ids, res, arrival_s, RequestKeys(token_ids))
        rid = f"r{spec.idx}"
        self.flights[rid] = flight
        role = PROMPT if self._choose_path(flight) == DISAGGREGATED else NORMAL
        engine = self._choose(role, flight)
        params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
        try:
            engine.engine.add_request(rid, token_ids, params)
        except ValueError as exc:
            self._fail(rid, str(exc))
            return
        engine.kick()

    def on_output(self, engine: SimEngine, out) -> None:
        flight = self.flights.get(out.request_id)
        if flight is None:
            return
        res = flight.result
        if out.new_token_ids:
            if not flight.output_ids:
                res.ttft_s = self.now - flight.arrival_s
                res.cached_tokens = out.num_cached_tokens
                self._prefilled(flight)
            else:
                res.itl_s.append(self.now - flight.last_token_s)
            flight.last_token_s = self.now
            flight.output_ids.extend(out.new_token_ids)
        if out.handed_off_block_ids is not None:
            self._hand_off(engine, flight, out)
        elif out.finished:
            if out.finish_reason in ("length", "stop"):
                self._done(out.request_id)
            else:
                self._fail(out.request_id, f"finished: {out.finish_reason}")

    # ------------------------------------------------------------------ the PD hand-off
    def _hand_off(self, prompt: SimEngine, flight: Flight, out) -> None:
        keys = prompt.engine.block_keys(out.request_id)
        comp = self._choose(COMPLETION, flight)
        comp.admissions.append(Handoff(flight, prompt, out.new_token_ids[0], keys))
        # A live completion engine reads its socket between steps: a hand-off that reaches it
        # mid-step is admitted (and its pull begins) when that step ends (`_deliver` retries).
        if not comp.busy:
            self.retry_admissions(comp)

    def retry_admissions(self, comp: SimEngine) -> None:
        """Admit waiting hand-offs in order, until one must wait for blocks (LATER)."""
        while comp.admissions:
            h = comp.admissions[0]
            rid = f"r{h.flight.spec.idx}"
            spec = h.flight.spec
            params = SamplingParams(max_tokens=spec.max_tokens, temperature=0.0, ignore_eos=True)
            alloc = comp.engine.add_prompted_request(rid, h.flight.token_ids, [], params,
                                                     h.first_token, 0.0, block_keys=h.block_keys)
            if alloc.status == AllocStatus.LATER:
                return
            comp.admissions.popleft()
            if alloc.status == AllocStatus.NEVER:
                h.prompt.engine.release_handed_off(rid)
                h.prompt.kick()
                self._fail(rid, "the completion engine can never hold this prompt")
                continue
            num_pull = len(alloc.block_ids) - alloc.num_cached_blocks
            comp.num_pulled_blocks += num_pull
            # The pull, after the pulls before it on this engine (one link: pulls that land
            # together are verified one after another, run 11 of bench/sim_validate.py: two
            # short prompts handed off with a 2,724-token one got their second token 125-142
            # ms after the first, not 11-20), and what the hand-off's path adds to it (the
            # first token's way to the router and on to the completion engine, the lease, the
            # commit: `path.handoff_ms`).
            comp.link_free_s = (max(self.now, comp.link_free_s)
                                + self.profile.transfer_ms(num_pull) / 1e3)
            self.at(comp.link_free_s + self.profile.handoff_path_ms() / 1e3, self._landed, h,
                    comp)

    def _landed(self, h: Handoff, comp: SimEngine) -> None:
        rid = f"r{h.flight.spec.idx}"
        comp.engine.commit_prompted(rid)
        h.prompt.engine.release_handed_off(rid)
        comp._drain_keys()
        h.prompt._drain_keys()
        comp.kick()
        h.prompt.kick()

    # ------------------------------------------------------------------ endings
    def _done(self, rid: str) -> None:
        flight = self.flights.pop(rid)
        self._uncharge(flight)
        res = flight.result
        res.ok, res.e2e_s = True, self.now - flight.arrival_s
        res.output_tokens = len(flight.output_ids)
        if self.planner is not None:
            self.outcomes.append(Outcome(self.now, res.ttft_s, res.tpot_s, True))
        if self.on_done is not None:
            self.on_done(flight)

    def _fail(self, rid: str, error: str) -> None:
        flight = self.flights.pop(rid)
        self._uncharge(flight)
        flight.result.error = error[:300]
        flight.result.e2e_s = self.now - flight.arrival_s
        if self.planner is not None:
            self.outcomes.append(Outcome(self.now, flight.result.ttft_s, 0.0, False))
        if self.on_done is not None:
            self.on_done(flight)

    # ------------------------------------------------------------------ after the run
    def check_drained(self) -> None:
        """Every engine idle with all its blocks free (leases released, nothing left)."""
        for engines in self.engines.values():
            for e in engines:
                free, total = e.engine.num_free_blocks(), e.engine.num_total_blocks()
                assert free == total and not e.engine.has_unfinished(), \
                    f"{e.name}: {free} of {total} blocks free, unfinished " \
                    f"{e.engine.has_unfinished()} after the run"
                assert e.num_inflight == 0 and e.active_blocks == 0, (e.name, e.num_inflight)
                assert e.work == EngineWork(), (e.name, e.work)

    def path_record(self) -> list[dict]:
        """The paths taken, as the router's `baton_router_path_total{path,reason}`."""
        return [{"path": path, "reason": reason, "count": n}
                for (path, reason), n in sorted(self.path_counts.items())]

    def fleet_record(self) -> dict:
        """Per engine: busy time, steps, pulled KV (blocks, bytes), prefix cache hit rate."""
        bpb = self.profile.model.kv_bytes_per_block
        engines = []
        for role_engines in self.engines.values():
            for e in role_engines:
                stats = e.engine.stats()
                query = stats["prefix_cache_query_tokens"]
                engines.append({
                    "name": e.name, "role": e.role, "busy_s": e.busy_s,
                    "prefill_busy_s": e.prefill_busy_s,
                    "busy_fraction": e.busy_s / self.now if self.now else 0.0,
                    "num_steps": e.runner.num_steps,
                    "num_prompt_steps": e.engine.num_prompt_steps,
                    "num_prompt_tokens": e.engine.num_prompt_tokens,
                    "num_generated_tokens": e.engine.num_generated_tokens,
                    "num_preemptions": stats["num_preemptions"],
                    "pulled_kv_blocks": e.num_pulled_blocks,
                    "pulled_kv_bytes": e.num_pulled_blocks * bpb,
                    "cache_hit_rate": stats["prefix_cache_hit_tokens"] / query if query else 0.0,
                    "num_free_blocks": stats["num_free_blocks"],
                    "num_total_blocks": stats["num_total_blocks"]})
        record = {"engines": engines, "virtual_s": self.now,
                  "pulled_kv_bytes": sum(e["pulled_kv_bytes"] for e in engines),
                  "path_total": self.path_record(),
                  "path_by_kind": {k: dict(sorted(v.items()))
                                   for k, v in sorted(self.kind_paths.items())}}
        if self.planner is not None:
            self._note_roles()
            record["roles_over_time"] = self.roles_over_time
            record["planner_decisions"] = self.decisions
        return record
