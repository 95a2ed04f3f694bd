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
request alone on the same fleet shape (without a `path`, and without the prepare: the prompts
go as token ids, so the router tokenizes nothing):
- request_ms: the median of live TTFT - predicted TTFT, over every shape's requests;
- handoff_ms: the median of live first gap - predicted first gap (the second token after the
  first) on the disaggregated fleet.
Measured on mock engines, not on the real ones: a real engine's forward varies by more than
the path takes, and the path's code is the same.

`speed_probe` asks the other question, of real engines already serving: how fast is this host
now, against the profile? A shared machine's speed drifts (here 10-30% within an hour, for the
same work: bench/sim_validate.py runs 5 and 6, 6 December 2026), and a profile is one moment of
it. The probe sends a fixed set of requests (lone prompts, then a burst that decodes together)
to the fleet, reads the engines' busy seconds off their /metrics before and after, and divides
by the busy seconds the simulator predicts for the same requests on the same fleet shape:
`Profile.scaled(factor)` then predicts at the host's present speed.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from baton.engine.config import SERVE_MAX_NUM_BATCHED_TOKENS
from baton.ops.ports import free_port
from baton.perf.profile import PathCost, Profile
from baton.perf.profile import load as load_profile
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
    samples: list[Sample] = []
    for shape in cfg.shapes:
        specs = _specs(cfg, shape)
        predicted = _predict(profile, cfg, shape, specs)
        with _MockFleet(profile_file, shape, cfg) as url, \
                httpx.Client(base_url=url, timeout=cfg.request_timeout_s) as client:
            model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
            # A first connection, not measured, with a prompt of its own: one of the specs'
            # would make that spec a prefix-cache hit the simulator does not predict.
            warm_up = words(random.Random(f"{cfg.seed}/{shape}/warm-up"), min(cfg.prompt_lens))
            _send(client, model, tok.encode(warm_up), cfg.max_tokens)
            live = [_send(client, model, tok.encode(spec.prompt), spec.max_tokens)
                    for spec in specs]
        for spec, (ttft, gap), (p_ttft, p_gap) in zip(specs, live, predicted, strict=True):
            samples.append(Sample(shape, spec.num_prompt_words, ttft, p_ttft, gap, p_gap))
    request = [s.ttft_ms - s.predicted_ttft_ms for s in samples]
    handoff = [s.gap_ms - s.predicted_gap_ms for s in samples if s.shape == "pd"]
    cost = PathCost(request_ms=round(max(0.0, statistics.median(request)), 3),
                    handoff_ms=round(max(0.0, statistics.median(handoff)), 3) if handoff else 0.0,
                    num_requests=len(samples))
    return cost, samples


def _specs(cfg: CalibrateConfig, shape: str) -> list[RequestSpec]:
    """The shape's lone requests: every length `repeats` times, random words (no prefix-cache
    hit between them), one a minute in the simulator (each alone)."""
    rng = random.Random(f"{cfg.seed}/{shape}")
    lens = [n for _ in range(cfg.repeats) for n in cfg.prompt_lens]
    return [RequestSpec(idx=i, kind="fixed", prompt=words(rng, n), num_prompt_words=n,
                        max_tokens=cfg.max_tokens, arrival_s=60.0 * i)
            for i, n in enumerate(lens)]


def _predict(profile: Profile, cfg: CalibrateConfig, shape: str,
             specs: list[RequestSpec]) -> list[tuple[float, float]]:
    """(TTFT, first gap) in ms per spec, as the simulator predicts them without a path."""
    bare = replace(profile, path=None, prepare=None)
    fleet = replace(SHAPES[shape], max_num_batched_tokens=cfg.max_num_batched_tokens)
    record = simulate(bare, SimConfig(fleet=fleet, num_requests=len(specs),
                                      label=f"calibrate_{shape}"), None, specs=specs)
    by_idx = {r["idx"]: r for r in record["requests"]}
    return [(1e3 * by_idx[s.idx]["ttft_s"], 1e3 * by_idx[s.idx]["itl_s"][0]) for s in specs]


class _MockFleet:
    """`baton up --mock PROFILE` of one shape, as a user starts it; its URL while entered."""

    def __init__(self, profile_file: str | Path, shape: str, cfg: CalibrateConfig,
                 metrics: bool = False) -> None:
        """`metrics`: the engines serve /metrics (`metrics_urls` once entered)."""
        self.port = free_port()
        self.cmd = [sys.executable, "-m", "baton_cli", "up", "--port", str(self.port),
                    "--mock", str(profile_file), *([] if metrics else ["--no-metrics"]),
                    "--ready-timeout", str(cfg.ready_timeout_s), *_UP_FLAGS[shape], "--",
                    "--max-num-batched-tokens", str(cfg.max_num_batched_tokens)]
        self.ready_timeout_s = cfg.ready_timeout_s
        self.proc: subprocess.Popen | None = None
        self.metrics_urls: list[str] = []

    def __enter__(self) -> str:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True,
                                     start_new_session=True)
        lines: list[str] = []
        reader = threading.Thread(target=self._read, args=(lines,), daemon=True)
        reader.start()
        deadline = time.monotonic() + self.ready_timeout_s
        while not any("Ctrl-C stops" in line for line in lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"baton up --mock not up within {self.ready_timeout_s:g} s "
                                   f"(exit {self.proc.returncode}): {' | '.join(lines[-3:])}")
            time.sleep(0.05)
        # The banner's engine lines: "  <engine>  metrics http://.../metrics" (not the router's).
        self.metrics_urls = [line.split("  metrics ", 1)[1].split()[0] for line in lines
                             if "  metrics http" in line and "router" not in line]
        return f"http://127.0.0.1:{self.port}"

    def _read(self, lines: list[str]) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:  # read to the end: a full pipe would block baton up
            lines.append(line.rstrip())

    def __exit__(self, *exc) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # its whole session: engines and router too
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


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
    lone_lens: tuple[int, ...] = (64, 256, 512)  # prompts sent one at a time (tokens)
    burst: int = 8  # then this many prompts of burst_len at once: a decode batch
    burst_len: int = 32
    max_tokens: int = 16
    request_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.lone_lens or min(self.lone_lens) < 1 or self.burst < 0 \
                or self.burst_len < 1 or self.max_tokens < 2:
            raise ValueError(f"a probe needs lone prompts >= 1 token, burst >= 0, burst_len "
                             f">= 1 and max_tokens >= 2, got {self}")


@dataclass
class SpeedProbe:
    """Real busy seconds over predicted ones, for the same requests on the same fleet."""

    factor: float
    real_busy_s: float
    predicted_busy_s: float
    real_by_role: dict[str, float]
    predicted_by_role: dict[str, float]


def _probe_specs(cfg: ProbeConfig) -> list[RequestSpec]:
    """The lone prompts one a minute, then the burst at once (random words: no prefix-cache
    hit between them)."""
    rng = random.Random(f"{cfg.seed}/probe")
    lens = [*cfg.lone_lens, *[cfg.burst_len] * cfg.burst]
    times = [60.0 * i for i in range(len(cfg.lone_lens))]
    times += [60.0 * len(cfg.lone_lens)] * cfg.burst
    return [RequestSpec(idx=i, kind="fixed", prompt=words(rng, n), num_prompt_words=n,
                        max_tokens=cfg.max_tokens, arrival_s=t)
            for i, (n, t) in enumerate(zip(lens, times, strict=True))]


def _busy_by_role(metrics_urls: list[str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in metrics_urls:
        for engine in scrape(url).values():
            out[engine.role] = out.get(engine.role, 0.0) + engine.values.get("busy_s", 0.0)
    return out


def speed_probe(url: str, metrics_urls: list[str], profile: Profile, fleet: FleetConfig,
                cfg: ProbeConfig | None = None) -> SpeedProbe:
    """The probe's requests through the live fleet at `url` (its engines' /metrics at
    `metrics_urls`, their prefix caches empty: reset them first), against the simulator's
    busy seconds for the same requests on `fleet` (the live fleet's shape and limits).
    `factor` > 1: the host runs slower than the profile. Raises RuntimeError on a failed
    request, OSError/ValueError when a /metrics cannot be read."""
    cfg = cfg or ProbeConfig()
    specs = _probe_specs(cfg)
    record = simulate(profile, SimConfig(fleet=fleet, num_requests=len(specs),
                                         label="speed_probe"), None, specs=specs)
    predicted: dict[str, float] = {}
    for e in record["fleet"]["engines"]:
        predicted[e["role"]] = predicted.get(e["role"], 0.0) + e["busy_s"]
    tok = WordTokenizer(profile.model.vocab_size)
    prompts = [tok.encode(s.prompt) for s in specs]
    num_lone = len(cfg.lone_lens)
    before = _busy_by_role(metrics_urls)
    with httpx.Client(base_url=url, timeout=cfg.request_timeout_s) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        for ids in prompts[:num_lone]:
            _send(client, model, ids, cfg.max_tokens)
        if cfg.burst:
            with ThreadPoolExecutor(cfg.burst) as pool:
                list(pool.map(lambda ids: _send(client, model, ids, cfg.max_tokens),
                              prompts[num_lone:]))
    time.sleep(SETTLE_S)  # the engines publish their counters every 0.25 s
    after = _busy_by_role(metrics_urls)
    real = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
    real_s, predicted_s = sum(real.values()), sum(predicted.values())
    if predicted_s <= 0 or real_s <= 0:
        raise RuntimeError(f"the probe measured no busy time (real {real_s:.3f} s, predicted "
                           f"{predicted_s:.3f} s): are the /metrics URLs the fleet's engines?")
    return SpeedProbe(real_s / predicted_s, real_s, predicted_s, real, predicted)
