"""The serving path's own latency, measured: the profile's optional `path` (docs/profile.md).

The simulator charges a request the profile's engine costs (its steps, the router's prepare,
the KV pull). A live request also crosses the serving path: the router's HTTP and routing work
and the ZMQ hops both ways before its first token reaches the client, and, disaggregated, the
hand-off between its first and second token (the prompt engine's first token to the router,
the completion engine's admission and lease, the NIXL pull's own round trips, the commit). On
this machine that is ~6 ms before the first token and 0.4-2.8 ms a hand-off beyond the pull
(6 December 2026): a few percent of a short request's TTFT, which a simulator without it
under-predicts.

`calibrate_path` measures it where nothing else varies: `baton up --mock PROFILE` (the real
router, engine loop, scheduler, ZMQ, registry and NIXL; each forward a sleep of the profile's
predicted time), one request at a time, each against the simulator's prediction of the same
request alone on the same fleet shape (without the prepare: the prompts go as token ids, so
the router tokenizes nothing; and with no path but the step gap below):
- step_gap_ms: the engine loop's own work between two steps, off the mock engines' /metrics
  during the requests (loop seconds less busy seconds over steps, the engines that decode);
- request_ms: the median of live TTFT - predicted TTFT, over every shape's requests;
- handoff_ms: the median of live first gap - predicted first gap (the second token after the
  first) on the disaggregated fleet;
- service_step_ms and service_token_ms: the CPU the router and a streaming client take for the
  engines' outputs, per step that emits tokens and per token: on the first shape's fleet, one
  stream decoding alone, then several at once (`stream_counts`), the router process's and
  this process's CPU seconds against the engines' steps and tokens over each phase (their
  /metrics), two equations solved for the two costs (non-negative). Where the router and the
  clients share the engines' cores (`FleetConfig.service_cores`), the simulator takes that CPU
  from the engines' steps: on this 2-core host a prompt step beside one or four streams ran
  x1.11 (bench/service_steal.py, 7 December 2026), its threads waiting for the core 9 -> 36-39
  ms a step, the completion engine's 2 -> 32-50, the router and this kind of client using
  0.10-0.11 of a core.
Measured on mock engines, not on the real ones: a real engine's forward varies by more than
the path takes, and the path's code is the same.

`speed_probe` asks the other question, of real engines already serving: how fast is this host
now, against the profile? A shared machine's speed drifts (here 10-30% within an hour, for the
same work: bench/sim_validate.py runs 5 and 6, 6 December 2026), and a profile is one moment of
it; nor does it drift alike for every step (a decode step of one row, which reads every weight
for one token, slowed 17% in an hour while steps of eight rows did not: run 8's note). The
probe sends three fixed sets of requests to the fleet (lone prompts, one stream decoding alone,
a burst that decodes together), reads the engines' busy seconds off their /metrics before and
after each, and sets them against the simulator's seconds of prompt steps and of decode steps
for the same requests on the same fleet shape: three equations, a prompt-step and a
decode-step factor fitted to them, and `Profile.scaled(prefill, decode)` predicts at the
host's present speed. (Three factors, a decode step's fixed part apart from its part per row,
solved the three phases exactly and predicted worse: bench/sim_validate.py run 9.)
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import numpy as np

from baton.engine.config import SERVE_MAX_NUM_BATCHED_TOKENS
from baton.ops.up_process import UpProcess
from baton.perf.profile import PathCost, Profile
from baton.perf.profile import load as load_profile
from baton.protocol import PROMPT
from baton.workload.fleet_metrics import SETTLE_S, scrape
from baton.workload.synthetic import RequestSpec
from baton.workload.words import WordTokenizer, words
from simulator.fleet import FleetConfig
from simulator.run import SimConfig, simulate

logger = logging.getLogger(__name__)

SHAPES = {"normal": FleetConfig(num_normal=1),
          "pd": FleetConfig(num_normal=0, num_prompt=1, num_completion=1)}
_UP_FLAGS = {"normal": ["--normal-engines", "1"],
             "pd": ["--prompt-engines", "1", "--completion-engines", "1"]}


@dataclass
class CalibrateConfig:
    shapes: tuple[str, ...] = ("normal", "pd")  # of SHAPES: "pd" gives handoff_ms
    prompt_lens: tuple[int, ...] = (32, 128, 512)  # tokens; each prompt one step (<= chunk)
    repeats: int = 3  # requests of each length per shape
    max_tokens: int = 4  # enough for a first gap
    max_num_batched_tokens: int = SERVE_MAX_NUM_BATCHED_TOKENS  # `baton engine`'s default
    ready_timeout_s: float = 90.0  # `baton up --mock` to its banner
    request_timeout_s: float = 30.0
    seed: int = 0
    # The service's CPU: streams decoding `stream_tokens` each, this many at once per phase
    # (two counts at least: one phase alone cannot tell a step's cost from a token's). ~2 s a
    # phase here: shorter ones moved the two costs 2-3x between profiles an hour apart.
    stream_counts: tuple[int, ...] = (1, 4)
    stream_tokens: int = 192

    def __post_init__(self) -> None:
        unknown = [s for s in self.shapes if s not in SHAPES]
        if unknown or not self.shapes:
            raise ValueError(f"shapes must be some of {sorted(SHAPES)}, got {list(self.shapes)}")
        if not self.prompt_lens or min(self.prompt_lens) < 1 \
                or max(self.prompt_lens) > self.max_num_batched_tokens:
            raise ValueError(f"prompt_lens must be in 1..{self.max_num_batched_tokens} (one "
                             f"prompt step each), got {list(self.prompt_lens)}")
        if self.repeats < 1 or self.max_tokens < 2:
            raise ValueError(f"repeats must be >= 1 and max_tokens >= 2, got {self.repeats} and "
                             f"{self.max_tokens}")
        if len(set(self.stream_counts)) < 2 or min(self.stream_counts) < 1 \
                or self.stream_tokens < 2:
            raise ValueError(f"stream_counts must hold two different counts >= 1 and "
                             f"stream_tokens must be >= 2, got {list(self.stream_counts)} and "
                             f"{self.stream_tokens}")


@dataclass
class Sample:
    """One lone request: live and predicted TTFT and first gap, in milliseconds."""

    shape: str
    prompt_tokens: int
    ttft_ms: float
    predicted_ttft_ms: float
    gap_ms: float
    predicted_gap_ms: float


def calibrate_path(profile_file: str | Path, cfg: CalibrateConfig | None = None
                   ) -> tuple[PathCost, list[Sample]]:
    """The serving path's cost for this profile's engines on this machine, and the samples."""
    cfg = cfg or CalibrateConfig()
    profile = load_profile(profile_file)
    tok = WordTokenizer(profile.model.vocab_size)  # the simulator's ids, sent as the prompts
    runs = []
    loop = np.zeros(2)  # the engines' loop seconds beyond their steps, and their steps
    service = (0.0, 0.0)
    for shape in cfg.shapes:
        specs = _specs(cfg, shape)
        with mock_fleet(profile_file, shape, cfg, metrics=True) as fleet, \
                httpx.Client(base_url=fleet.base_url, timeout=cfg.request_timeout_s) as client:
            model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            # A first connection, not measured, with a prompt of its own: one of the specs'
            # would make that spec a prefix-cache hit the simulator does not predict.
            warm_up = words(random.Random(f"{cfg.seed}/{shape}/warm-up"), min(cfg.prompt_lens))
            _send(client, model, tok.encode(warm_up), cfg.max_tokens)
            urls = list(fleet.metrics_urls.values())
            time.sleep(SETTLE_S)  # the engines publish their counters every 0.25 s
            before = _loop_s(urls)
            live = [_send(client, model, tok.encode(spec.prompt), spec.max_tokens)
                    for spec in specs]
            time.sleep(SETTLE_S)
            loop += _loop_s(urls) - before
            if shape == cfg.shapes[0]:
                service = _service_cpu(fleet, client, model, tok, cfg)
        runs.append((shape, specs, live))
    # The loop's own work a step first: the first token's and the hand-off's path are what the
    # live requests take beyond the simulator's prediction with it.
    step_gap_ms = round(float(max(0.0, 1e3 * loop[0] / loop[1])), 4) if loop[1] > 0 else 0.0
    samples: list[Sample] = []
    for shape, specs, live in runs:
        predicted = _predict(profile, cfg, shape, specs, step_gap_ms)
        for spec, (ttft, gap), (p_ttft, p_gap) in zip(specs, live, predicted, strict=True):
            samples.append(Sample(shape, spec.num_prompt_words, ttft, p_ttft, gap, p_gap))
    request = [s.ttft_ms - s.predicted_ttft_ms for s in samples]
    handoff = [s.gap_ms - s.predicted_gap_ms for s in samples if s.shape == "pd"]
    cost = PathCost(request_ms=round(max(0.0, statistics.median(request)), 3),
                    handoff_ms=round(max(0.0, statistics.median(handoff)), 3) if handoff else 0.0,
                    num_requests=len(samples), step_gap_ms=step_gap_ms,
                    service_step_ms=round(service[0], 4), service_token_ms=round(service[1], 4))
    return cost, samples


def _service_cpu(fleet: UpProcess, client: httpx.Client, model: str, tok: WordTokenizer,
                 cfg: CalibrateConfig) -> tuple[float, float]:
    """(ms a step, ms a token) of the router's and this client's CPU while streams decode: a
    phase per `cfg.stream_counts`, CPU seconds = step_ms * steps + token_ms * tokens, the steps
    and tokens off the engines' /metrics. (This process does nothing else meanwhile: its CPU is
    the client's.)"""
    import psutil  # the dev extra's, as httpx here

    router = [c for c in psutil.Process(fleet.proc.pid).children(recursive=True)
              if "router" in c.cmdline()]
    if len(router) != 1:
        raise RuntimeError(f"expected one router process under `baton up`, found {len(router)}")
    me = psutil.Process()
    urls = list(fleet.metrics_urls.values())

    def cpu_s() -> float:
        return sum(_cpu_s(p) for p in (router[0], me))

    def counts() -> np.ndarray:
        return np.sum([(e.values["num_steps"], e.values["num_generated_tokens"])
                       for url in urls for e in scrape(url).values()], axis=0)

    rng = random.Random(f"{cfg.seed}/service")
    cpu = []
    time.sleep(SETTLE_S)  # the engines publish their counters every 0.25 s
    seen = [counts()]
    with ThreadPoolExecutor(max(cfg.stream_counts)) as pool:
        for n in cfg.stream_counts:
            prompts = [tok.encode(words(rng, 8)) for _ in range(n)]
            cpu0 = cpu_s()
            list(pool.map(lambda p: _send(client, model, p, cfg.stream_tokens), prompts))
            cpu.append(1e3 * (cpu_s() - cpu0))
            time.sleep(SETTLE_S)
            seen.append(counts())
    return _nonnegative_fit(np.diff(np.array(seen, dtype=np.float64), axis=0), np.array(cpu))


def thread_schedstat_ms(pid: int) -> dict[int, np.ndarray]:
    """Per thread id, (time on a core, time waiting for one) in ms, from Linux's schedstat
    (nanoseconds); empty where there is none (another OS, the process gone)."""
    found = {}
    for path in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            run_ns, wait_ns = path.read_text().split()[:2]
            found[int(path.parent.name)] = np.array((int(run_ns) / 1e6, int(wait_ns) / 1e6))
        except (OSError, ValueError):  # a thread gone meanwhile
            continue
    return found


def schedstat_ms(pid: int) -> np.ndarray | None:
    """(time on a core, time waiting for one) of all a process's threads, in ms (schedstat);
    None where there is none."""
    threads = thread_schedstat_ms(pid)
    return sum(threads.values(), np.zeros(2)) if threads else None


def _cpu_s(proc) -> float:
    """A process's CPU seconds, all its threads: schedstat's where there is one, else psutil's
    user + system times (clock ticks: 10 ms here, a tenth of a phase's)."""
    found = schedstat_ms(proc.pid)
    return found[0] / 1e3 if found is not None else sum(proc.cpu_times()[:2])


def _nonnegative_fit(a: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least squares of y = a @ (x0, x1) with both >= 0: where the free fit drives one below 0,
    the other alone."""
    x = np.linalg.lstsq(a, y, rcond=None)[0]
    if min(x) >= 0:
        return float(x[0]), float(x[1])
    alone = [float(y @ a[:, i] / (a[:, i] @ a[:, i])) if a[:, i].any() else 0.0 for i in (0, 1)]
    err = [np.sum((y - alone[i] * a[:, i]) ** 2) for i in (0, 1)]
    keep = int(np.argmin(err))
    return (max(0.0, alone[0]), 0.0) if keep == 0 else (0.0, max(0.0, alone[1]))


def _loop_s(metrics_urls: list[str]) -> np.ndarray:
    """The engines' loop seconds beyond their steps (`baton_engine_loop_seconds_total` less
    the busy seconds), and their steps, summed over the engines that decode. A prompt engine's
    loop work after a step is its hand-off's (the blocks held, the handle sent: `handoff_ms`
    holds it), not the gap between steps of one stream."""
    out = np.zeros(2)
    for engine in (e for url in metrics_urls for e in scrape(url).values()):
        if engine.role != PROMPT:
            out += (engine.values["loop_s"] - engine.values["busy_s"],
                    engine.values["num_steps"])
    return out


def _specs(cfg: CalibrateConfig, shape: str) -> list[RequestSpec]:
    """The shape's lone requests: every length `repeats` times, random words (no prefix-cache
    hit between them), one a minute in the simulator (each alone)."""
    rng = random.Random(f"{cfg.seed}/{shape}")
    lens = [n for _ in range(cfg.repeats) for n in cfg.prompt_lens]
    return [RequestSpec(idx=i, kind="fixed", prompt=words(rng, n), num_prompt_words=n,
                        max_tokens=cfg.max_tokens, arrival_s=60.0 * i)
            for i, n in enumerate(lens)]


def _predict(profile: Profile, cfg: CalibrateConfig, shape: str, specs: list[RequestSpec],
             step_gap_ms: float = 0.0) -> list[tuple[float, float]]:
    """(TTFT, first gap) in ms per spec, as the simulator predicts them with no path but the
    engine loop's `step_gap_ms`."""
    bare = replace(profile, path=PathCost(step_gap_ms=step_gap_ms), prepare=None)
    fleet = replace(SHAPES[shape], max_num_batched_tokens=cfg.max_num_batched_tokens)
    record = simulate(bare, SimConfig(fleet=fleet, num_requests=len(specs),
                                      label=f"calibrate_{shape}"), None, specs=specs)
    by_idx = {r["idx"]: r for r in record["requests"]}
    return [(1e3 * by_idx[s.idx]["ttft_s"], 1e3 * by_idx[s.idx]["itl_s"][0]) for s in specs]


def mock_fleet(profile_file: str | Path, shape: str, cfg: CalibrateConfig,
               metrics: bool = False) -> UpProcess:
    """`baton up --mock PROFILE` of one shape, as a user starts it, not yet waited for (a
    context manager: up on entry, stopped on exit). `metrics`: the engines serve /metrics
    (`metrics_urls` once up)."""
    return UpProcess.start(
        ["--mock", str(profile_file), *([] if metrics else ["--no-metrics"]),
         "--ready-timeout", str(cfg.ready_timeout_s), *_UP_FLAGS[shape], "--",
         "--max-num-batched-tokens", str(cfg.max_num_batched_tokens)],
        ready_timeout_s=cfg.ready_timeout_s, keep_stderr=False)


def _send(client: httpx.Client, model: str, prompt_ids: list[int], max_tokens: int
          ) -> tuple[float, float]:
    """One streamed completion of a prompt given as token ids (the simulator's own, so both
    sides run the same prompt); (TTFT, first gap) in ms at this client. A chunk is a token (the
    router streams one per engine delta; a lone request's deltas hold one token each)."""
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    times: list[float] = []
    t0 = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"calibration request refused: {resp.status_code} "
                               f"{resp.read()[:200]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("error"):
                raise RuntimeError(f"calibration request failed: {chunk['error']}")
            if chunk.get("choices"):
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"calibration request streamed {len(times)} chunks, wanted >= 2")
    return 1e3 * (times[0] - t0), 1e3 * (times[1] - times[0])


@dataclass
class ProbeConfig:
    """Three phases, each timed on its own: prompts, one stream decoding, a batch decoding."""

    lone_lens: tuple[int, ...] = (64, 256, 512)  # prompts sent one at a time (tokens) ...
    lone_max_tokens: int = 2  # ... each with a token after the first (a short decode)
    solo_len: int = 16  # then one short prompt decoding alone (steps of one row) ...
    solo_max_tokens: int = 96
    burst: int = 8  # then this many short prompts at once, decoding together
    burst_len: int = 16
    burst_max_tokens: int = 64
    request_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lone_lens or min(self.lone_lens) < 1 or self.burst < 2 \
                or min(self.burst_len, self.solo_len) < 1 \
                or min(self.lone_max_tokens, self.burst_max_tokens, self.solo_max_tokens) < 2:
            raise ValueError(f"a probe needs lone prompts >= 1 token, a solo prompt >= 1 token, "
                             f"a burst >= 2 of prompts >= 1 token and max_tokens >= 2 (a "
                             f"stream's second token), got {self}")


@dataclass
class SpeedProbe:
    """This host's speed against the profile's: the real engines' busy seconds in prompt steps
    and in decode steps against the simulator's (or, from engines that do not split their busy
    time, each phase's whole busy seconds fitted with the two factors)."""

    prefill_factor: float
    decode_factor: float
    factor: float  # all real busy seconds over all predicted ones
    misfit: float  # the factors' largest error on a phase's busy seconds, relative
    real_busy_s: list[float]  # per phase: prompts, one stream, a batch
    predicted_prefill_s: list[float]  # per phase, the simulator's prompt steps
    predicted_decode_s: list[float]  # and its decode steps
    # Per phase, the real engines' seconds in prompt steps (baton_engine_prompt_busy_seconds);
    # None where an engine does not expose it: the factors were then fitted (`fit_speed`).
    real_prefill_s: list[float] | None = None


def _probe_phases(cfg: ProbeConfig) -> list[list[RequestSpec]]:
    """The lone prompts one a minute, then the solo stream, then the burst at once (random
    words: no prefix-cache hit between any two)."""
    rng = random.Random(f"{cfg.seed}/probe")
    lone = [RequestSpec(idx=i, kind="fixed", prompt=words(rng, n), num_prompt_words=n,
                        max_tokens=cfg.lone_max_tokens, arrival_s=60.0 * i)
            for i, n in enumerate(cfg.lone_lens)]
    solo = [RequestSpec(idx=len(lone), kind="fixed", prompt=words(rng, cfg.solo_len),
                        num_prompt_words=cfg.solo_len, max_tokens=cfg.solo_max_tokens,
                        arrival_s=0.0)]
    burst = [RequestSpec(idx=len(lone) + 1 + i, kind="fixed", prompt=words(rng, cfg.burst_len),
                         num_prompt_words=cfg.burst_len, max_tokens=cfg.burst_max_tokens,
                         arrival_s=0.0)
             for i in range(cfg.burst)]
    return [lone, solo, burst]


def _busy_s(metrics_urls: list[str]) -> tuple[float, float | None]:
    """The engines' busy seconds, and of them those in prompt steps (None if an engine does
    not say)."""
    busy, prompt = 0.0, 0.0
    for engine in (e for url in metrics_urls for e in scrape(url).values()):
        busy += engine.values.get("busy_s", 0.0)
        split = engine.values.get("prefill_busy_s")
        prompt = None if prompt is None or split is None else prompt + split
    return busy, prompt


def speed_factors(prefill_s: Sequence[float], decode_s: Sequence[float],
                  real_s: Sequence[float], real_prefill_s: Sequence[float]
                  ) -> tuple[float, float, float]:
    """(prefill_factor, decode_factor, misfit) of phases whose real busy seconds are `real_s`,
    `real_prefill_s` of them in prompt steps, and whose simulated ones are `prefill_s` in prompt
    steps and `decode_s` in decode steps: each factor the real seconds of its kind of step over
    the simulated ones, all phases together; misfit, the factors' largest relative error on a
    phase's whole busy seconds (how differently the phases' steps ran)."""
    pre, dec, real = (np.asarray(v, dtype=np.float64) for v in (prefill_s, decode_s, real_s))
    fp = float(np.sum(real_prefill_s)) / float(pre.sum())
    fd = float(real.sum() - np.sum(real_prefill_s)) / float(dec.sum())
    return fp, fd, float(np.abs((fp * pre + fd * dec) / real - 1.0).max())


def fit_speed(prefill_s: Sequence[float], decode_s: Sequence[float],
              real_s: Sequence[float]) -> tuple[float, float, float]:
    """(prefill_factor, decode_factor, misfit) of phases whose real busy seconds are `real_s`
    and whose simulated ones are `prefill_s` in prompt steps and `decode_s` in decode steps,
    where the real engines do not say which of their seconds were prompt steps (engines before
    baton_engine_prompt_busy_seconds; the probes of runs 7-10 of bench/sim_validate.py):
    real = prefill_factor * prefill + decode_factor * decode, least squares relative to each
    phase's real time (the phases weigh alike, whatever their length); misfit, the largest
    relative error of the fit on a phase. The prompts' phase is mostly prompt steps, the
    others mostly decode steps (one row, then a batch: the light and the loaded decode step,
    which this host does not always slow alike), so the fit is far from singular."""
    a = np.array([prefill_s, decode_s], dtype=np.float64).T / np.array(real_s)[:, None]
    fp, fd = np.linalg.lstsq(a, np.ones(len(real_s)), rcond=None)[0]
    return float(fp), float(fd), float(np.abs(a @ np.array([fp, fd]) - 1.0).max())


def probe_prediction(profile: Profile, fleet: FleetConfig, cfg: ProbeConfig | None = None
                     ) -> tuple[list[float], list[float]]:
    """Per phase of the probe, the simulator's seconds in prompt steps and in decode steps on
    `fleet` (what `speed_probe` divides the real engines' by; again for another profile of
    the same host: bench/sim_validate.py --repredict)."""
    pre, dec = [], []
    for specs in _probe_phases(cfg or ProbeConfig()):
        record = simulate(profile, SimConfig(fleet=fleet, num_requests=len(specs),
                                             label="speed_probe"), None, specs=specs)
        engines = record["fleet"]["engines"]
        pre.append(sum(e["prefill_busy_s"] for e in engines))
        dec.append(sum(e["busy_s"] - e["prefill_busy_s"] for e in engines))
    return pre, dec


def speed_probe(url: str, metrics_urls: list[str], profile: Profile, fleet: FleetConfig,
                cfg: ProbeConfig | None = None) -> SpeedProbe:
    """The probe's requests through the live fleet at `url` (its engines' /metrics at
    `metrics_urls`, their prefix caches empty: reset them first), each phase's busy seconds
    against the simulator's for the same requests on `fleet` (the live fleet's shape and
    limits): the engines' seconds in prompt steps over the simulator's are prefill_factor,
    their seconds in decode steps over the simulator's decode_factor (`speed_factors`); from
    engines that do not split their busy time, real = prefill_factor * predicted prompt steps
    + decode_factor * predicted decode steps, one equation a phase, fitted by least squares
    (`fit_speed`). A factor > 1: slower than the profile. Raises RuntimeError on a failed
    request, a phase without busy time or a factor <= 0; OSError/ValueError when a /metrics
    cannot be read."""
    cfg = cfg or ProbeConfig()
    phases = _probe_phases(cfg)
    tok = WordTokenizer(profile.model.vocab_size)
    pre, dec = probe_prediction(profile, fleet, cfg)
    real: list[float] = []
    real_pre: list[float] | None = []
    with httpx.Client(base_url=url, timeout=cfg.request_timeout_s) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        for specs in phases:
            prompts = [tok.encode(s.prompt) for s in specs]
            before, before_pre = _busy_s(metrics_urls)
            jobs = [(ids, s.max_tokens) for ids, s in zip(prompts, specs, strict=True)]
            if len(jobs) > 1 and len({s.arrival_s for s in specs}) == 1:  # the burst: at once
                with ThreadPoolExecutor(len(jobs)) as pool:
                    list(pool.map(lambda job: _send(client, model, *job), jobs))
            else:  # one at a time, as the simulator's (a minute apart)
                for job in jobs:
                    _send(client, model, *job)
            time.sleep(SETTLE_S)  # the engines publish their counters every 0.25 s
            after, after_pre = _busy_s(metrics_urls)
            real.append(after - before)
            if real_pre is not None and before_pre is not None and after_pre is not None:
                real_pre.append(after_pre - before_pre)
            else:
                real_pre = None
    if min(real) <= 0 or pre[0] <= 0 or min(dec[1:]) <= 0:
        raise RuntimeError(f"the probe measured no busy time (real {real} s, predicted "
                           f"prompt steps {pre} s, decode steps {dec} s): are the /metrics "
                           f"URLs the fleet's engines?")
    found = probe_of(pre, dec, real, real_pre)
    if not (found.prefill_factor > 0 and found.decode_factor > 0):  # noise past the phases
        raise RuntimeError(f"the probe's factors are not > 0 (real {real} s, {real_pre} s of "
                           f"them prompt steps, against prompt steps {pre} s and decode steps "
                           f"{dec} s: factors {found.prefill_factor:.3f}, "
                           f"{found.decode_factor:.3f})")
    return found


def probe_of(pre: list[float], dec: list[float], real: list[float],
             real_pre: list[float] | None) -> SpeedProbe:
    """The probe's record from each phase's simulated seconds in prompt steps (`pre`) and
    decode steps (`dec`) and the real engines' busy seconds (`real`, `real_pre` of them in
    prompt steps; None where the engines do not split them): the factors by `speed_factors`,
    or fitted by `fit_speed` without the split."""
    fp, fd, misfit = (fit_speed(pre, dec, real) if real_pre is None
                      else speed_factors(pre, dec, real, real_pre))
    return SpeedProbe(prefill_factor=fp, decode_factor=fd,
                      factor=sum(real) / (sum(pre) + sum(dec)), misfit=misfit,
                      real_busy_s=real, predicted_prefill_s=pre, predicted_decode_s=dec,
                      real_prefill_s=real_pre)
