"""Soak: `baton up` under a steady mixed load with periodic SIGKILLs; fails on any lost or wrong
request, on memory, fd or thread growth, and on a pool not whole at the end.

    .venv/bin/python bench/soak.py [--duration 600] [--kill-every 60] [--sample-every 5]

1. Deployment: `baton up` with 1 prompt + 2 completion engines (`--prompt-engines 2` adds a
   spare prompt engine, and then every third kill hits a prompt engine; with one there is no
   spare, so only completion engines are killed), --no-cpu-pinning, one torch thread per
   engine, small pools, and the exact mode (`--quantization none`): a migrated request is
   prefilled again, and only in the exact mode are its continued tokens equal to the
   undisturbed run's (in int4 the re-prefill's K/V differ in the last bits from the decode's,
   so a continuation equals the undisturbed text only up to near-ties of greedy). The soak
   writes its own cluster key dir (kv_transfer.auth.generate) so that it can probe the engines.
2. Pool warm-up, then references: distinct long prompts that write every block of each engine
   once (a pool is anonymous memory: its pages count in RSS from their first write, so its
   filling would read as growth), then every request of the mix once, undisturbed.
3. Load, --duration seconds at --concurrency: greedy and seeded completions, n=2 seeded
   (each choice checked), json_schema chat (exact, and valid JSON), long prompts, aborts (the
   client closes the stream after a few chunks) and disconnects (a non-streamed request whose
   client gives up mid-request). Every request is accounted: exact, wrong, failed (an error),
   aborted on purpose.
4. Kills, every --kill-every seconds once every engine of the role is back: a SIGKILL of the
   next completion engine in turn (it waits a moment for the victim to hold a request). The
   last --calm-tail seconds of load have no kills and open with another pool warm-up, so that
   the restarted engines' last lives are long enough to show a trend.
   `baton up` gets --max-restarts/--restart-window explicitly, sized so that the kills stay
   within the limit (its default, 5 restarts per 600 s, would give up on a soaked engine).
5. Samples every --sample-every seconds, per process (the launcher, the router, each engine;
   a restarted engine is a new series, by pid): RSS, open fds, threads; and per engine its
   free and total blocks, KV leases and pulls (a stats probe).
6. Quiescence: the load over, every victim back and every pool whole (no block owned, no lease,
   no pull) within --quiesce-timeout.
7. Verdict: exit 1 on a wrong or failed request, a pool not whole, an engine that died unkilled,
   or growth in a process that survived the soak: from --warmup seconds after the last pool
   warm-up of its life (an engine: once it has written its whole pool), the Theil-Sen slope of
   its RSS with its largest single rise taken out (a one-time step is not a leak; the step and
   the raw least-squares slope are printed beside it, and the private heap's slope, RSS less
   file-backed and shared pages, is in the JSON) over
   --max-rss-slope MiB/min, or its fds or threads more than --fd-tolerance /
   --thread-tolerance higher in the last third than in the first (a process too young for that
   window is shown without a trend). Prints a
   table, writes bench/results/soak.json (config, counts, kills, samples, verdict) and draws
   bench/results/soak.png (RSS and fds over time per process).
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baton_up import BatonUp, held, recoveries, start_baton_up, wait_back_and_whole  # noqa: E402

from kv_transfer.auth import generate  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = "SmolLM2-135M-Instruct"
NUM_BLOCKS = 128  # of 16 tokens, per engine
ENGINE_FLAGS = ["--num-threads", "1", "--num-blocks", str(NUM_BLOCKS), "--max-model-len", "512",
                "--quantization", "none"]
# Short strings: the object closes well within max_tokens, so it is whole JSON. Every request is
# short: on the shared 2-core machine an engine steps about once a second under the soak.
SCHEMA = {"type": "object", "properties": {"keeper": {"type": "string", "maxLength": 12},
                                           "year": {"type": "integer"},
                                           "story": {"type": "string", "maxLength": 24}},
          "required": ["keeper", "year", "story"], "additionalProperties": False}
WORDS = ("cat", "river", "lamp", "train", "violin", "cloud", "garden", "letter")
# A few hundred tokens: a long prefill, and a long re-prefill when migrated.
LONG_TEXT = " ".join(f"Chapter {i}: the {w} crossed the valley at dawn, and the villagers "
                     f"wrote down what the {w} had seen on the far side of the hills."
                     for i, w in enumerate(WORDS * 2))
LONG_TOKENS = 400  # about, in LONG_TEXT (a long request fits --max-model-len 512)


@dataclass
class SoakConfig:
    duration_s: float = 600.0  # of load (kills included)
    kill_every_s: float = 60.0  # between two kills (a kill waits for every victim to be back)
    sample_every_s: float = 5.0
    warmup_s: float = 30.0  # after a process's pool warm-up, left out of its trend
    # The last seconds of load run without kills, opened by a pool warm-up: the restarted
    # engines' last lives are then long enough to show a trend (0: kills to the end).
    calm_tail_s: float = 0.0
    min_kills: int = 0  # the load runs past duration_s until this many kills are done
    concurrency: int = 3  # client streams (the machine has 2 cores)
    num_prompt_engines: int = 1  # 2: a spare prompt engine, killed every third kill
    restart_window_s: float = 600.0  # --restart-window for `baton up` (its default)
    max_rss_slope_mib_min: float = 1.0
    fd_tolerance: int = 8
    thread_tolerance: int = 4
    quiesce_timeout_s: float = 240.0
    seed: int = 0
    results_dir: Path = HERE / "results"

    def __post_init__(self) -> None:
        for name in ("duration_s", "kill_every_s", "sample_every_s", "restart_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.calm_tail_s < self.duration_s:
            raise ValueError(f"calm_tail_s must be in [0, duration_s), got {self.calm_tail_s}")
        if self.num_prompt_engines not in (1, 2):
            raise ValueError(f"num_prompt_engines must be 1 or 2, got {self.num_prompt_engines}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")

    def max_restarts(self) -> int:
        """A restart limit the kills cannot reach: every kill of a window on one engine."""
        return math.ceil(self.restart_window_s / self.kill_every_s) + 1


# --------------------------------------------------------------------------- the mix
@dataclass
class Spec:
    """One request of the mix (by a unique name); `action` says what the client does."""
    name: str
    api: str  # "completions" or "chat"
    body: dict  # the create() arguments but model and stream
    action: str = "read"  # read | abort (close after a few chunks) | disconnect (give up)


def _spec(name: str, api: str, action: str = "read", **body) -> Spec:
    return Spec(name, api, body, action)


def build_mix() -> list[tuple[Spec, float]]:
    """(spec, weight) pairs: each kind of request equally likely, its specs shared alike."""
    ignore_eos = {"extra_body": {"ignore_eos": True}}
    greedy = [_spec(f"greedy-{i}", "completions", prompt=f"Item {i}: a short story about a {w}",
                    max_tokens=16, temperature=0, **ignore_eos) for i, w in enumerate(WORDS[:4])]
    seeded = [_spec(f"seeded-{i}", "completions", prompt=f"Write a poem about a {w}",
                    max_tokens=16, temperature=1.0, top_p=0.95, seed=100 + i, **ignore_eos)
              for i, w in enumerate(WORDS[4:6])]
    n2 = [_spec(f"n2-{i}", "completions", prompt=f"Three facts about the {w}:", n=2,
                max_tokens=16, temperature=1.0, seed=200 + i, **ignore_eos) for i, w in
          enumerate(WORDS[4:6])]
    structured = [_spec(f"json-{i}", "chat", messages=[
        {"role": "user", "content": f"Tell the {w} keeper's story as JSON."}],
        max_tokens=48, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA}})
        for i, w in enumerate(WORDS[:2])]
    long = [_spec(f"long-{i}", "completions", prompt=f"{LONG_TEXT}\nSummary {i}:",
                  max_tokens=8, temperature=0, **ignore_eos) for i in range(2)]
    abort = [_spec("abort", "completions", "abort", prompt="Count slowly to one hundred:",
                   max_tokens=32, temperature=0, **ignore_eos)]
    disconnect = [_spec("disconnect", "completions", "disconnect",
                        prompt="List the rivers of Europe:", max_tokens=32, temperature=0,
                        **ignore_eos)]
    kinds = (greedy, seeded, n2, structured, long, abort, disconnect)
    return [(spec, 1.0 / len(kind)) for kind in kinds for spec in kind]


ABORT_AFTER_CHUNKS = 3
DISCONNECT_AFTER_S = 1.5  # a non-streamed request of 32 tokens takes longer under the load


@dataclass
class Outcome:
    spec: str
    status: str  # exact | wrong | failed | aborted
    detail: str = ""
    started_s: float = 0.0
    took_s: float = 0.0


async def _send(client, spec: Spec) -> tuple[dict[int, str], dict[int, str | None], str]:
    """The texts and finish reasons by choice index, or (with an action) how it was cut off."""
    from openai import APITimeoutError

    kwargs = spec.body
    create = client.completions.create if spec.api == "completions" else \
        client.chat.completions.create
    if spec.action == "disconnect":
        try:
            reply = await create(model=MODEL, stream=False, timeout=DISCONNECT_AFTER_S,
                                 **kwargs)
        except APITimeoutError:  # the client went away mid-request
            return {}, {}, "disconnected"
        return ({c.index: c.text for c in reply.choices},
                {c.index: c.finish_reason for c in reply.choices}, "")
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    stream = await create(model=MODEL, stream=True, **kwargs)
    num_chunks = 0
    async for chunk in stream:
        for choice in chunk.choices:
            piece = choice.text if spec.api == "completions" else choice.delta.content
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
            num_chunks += bool(piece)
        if spec.action == "abort" and num_chunks >= ABORT_AFTER_CHUNKS:
            await stream.close()
            return texts, reasons, "closed"
    return texts, reasons, ""


def _check(spec: Spec, got, reference) -> tuple[str, str]:
    texts, reasons, cut = got
    if cut:
        return "aborted", cut
    if reference is not None and (texts, reasons) != reference[:2]:
        return "wrong", f"{texts!r} != {reference[0]!r} ({reasons} / {reference[1]})"
    if spec.api == "chat":
        try:
            json.loads(texts.get(0, ""))
        except ValueError as exc:
            return "wrong", f"not JSON ({exc}): {texts!r}"
    return "exact", ""


# --------------------------------------------------------------------------- load and kills
class Soak:
    def __init__(self, cfg: SoakConfig, baton: BatonUp) -> None:
        self.cfg, self.baton = cfg, baton
        self.mix = build_mix()
        self.references: dict[str, tuple] = {}  # spec name -> what _send returned
        self.outcomes: list[Outcome] = []
        self.kills: list[dict] = []
        self.warmups: list[float] = []  # when each pool warm-up ended (s since the load began)
        self.t0 = time.monotonic()

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    async def references_run(self) -> None:
        """Every spec once, undisturbed, all at once (the machine is slow; batches do not change
        the exact mode's tokens); an abort or a disconnect is read to its end (one that runs to
        its end under the load is checked against it)."""
        from openai import AsyncOpenAI

        async with AsyncOpenAI(base_url=f"{self.baton.base_url}/v1", api_key="none",
                               max_retries=0, timeout=180) as client:
            async def one(spec: Spec) -> None:
                got = await _send(client, Spec(spec.name, spec.api, spec.body))
                status, detail = _check(spec, got, None)
                assert status == "exact", f"reference {spec.name}: {detail}"
                self.references[spec.name] = got

            await asyncio.gather(*(one(s) for s, _ in self.mix))

    async def pool_warmup(self) -> None:
        """Distinct long prompts, --concurrency at a time (all at once, the last would wait past
        the router's prompt timeout on this machine), enough to write every block of each
        engine once (the plain free list hands out unused blocks first). A pool is anonymous
        memory whose pages count in RSS from their first write on: unwarmed, its filling reads
        as growth."""
        from openai import AsyncOpenAI

        num_prompts = math.ceil(2 * NUM_BLOCKS * 16 / LONG_TOKENS) + 2  # two completion engines
        round_ = len(self.warmups)
        sem = asyncio.Semaphore(self.cfg.concurrency)
        async with AsyncOpenAI(base_url=f"{self.baton.base_url}/v1", api_key="none",
                               max_retries=0, timeout=300) as client:
            async def one(k: int) -> None:
                async with sem:
                    await client.completions.create(
                        model=MODEL, prompt=f"Draft {round_}.{k}. {LONG_TEXT}", max_tokens=2,
                        temperature=0)

            await asyncio.gather(*(one(k) for k in range(num_prompts)))
        self.warmups.append(self.now())

    async def load(self, stop_at: float, is_killer_done) -> None:
        """Until stop_at and the killer is done (its last kill, its calm tail's warm-up)."""
        from openai import AsyncOpenAI

        specs, weights = zip(*self.mix, strict=True)
        async with AsyncOpenAI(base_url=f"{self.baton.base_url}/v1", api_key="none",
                               max_retries=0, timeout=180) as client:
            async def worker(rng: random.Random) -> None:
                while time.monotonic() < stop_at or not is_killer_done():
                    spec = rng.choices(specs, weights)[0]
                    started = time.monotonic()
                    try:
                        status, detail = _check(spec, await _send(client, spec),
                                                self.references[spec.name])
                    except Exception as exc:  # every failure is counted, not just the first
                        status, detail = "failed", f"{type(exc).__name__}: {exc}"
                    self.outcomes.append(Outcome(spec.name, status, detail[:300],
                                                 round(started - self.t0, 2),
                                                 round(time.monotonic() - started, 2)))

            await asyncio.gather(*(worker(random.Random(self.cfg.seed * 100 + i))
                                   for i in range(self.cfg.concurrency)))

    def victims(self) -> list[str]:
        """The kill order: completion engines in turn, a prompt engine every third kill when
        there is a spare one."""
        completion = sorted(e for e in self.baton.engines if e.startswith("completion"))
        prompt = sorted(e for e in self.baton.engines if e.startswith("prompt"))
        order = []
        for i in range(64):
            if len(prompt) > 1 and i % 3 == 2:
                order.append(prompt[(i // 3) % len(prompt)])
            else:
                order.append(completion[len(order) % len(completion)])
        return order

    async def all_back(self) -> None:
        while not all(self.baton.num_back(e) == sum(k["engine"] == e for k in self.kills)
                      for e in self.baton.engines):
            await asyncio.sleep(0.2)  # the last victim is still restarting

    async def killer(self, stop_at: float) -> None:
        """A kill every kill_every_s until the calm tail (or the end; later while fewer than
        min_kills are done: restarts are slow on a busy machine), which then opens with a pool
        warm-up once every victim is back."""
        order = self.victims()
        next_at = time.monotonic() + self.cfg.kill_every_s
        kills_until = stop_at - max(self.cfg.calm_tail_s, 5.0)  # 5 s: a kill to hit requests
        while True:
            await asyncio.sleep(max(0.0, min(next_at, kills_until) - time.monotonic()))
            await self.all_back()
            if time.monotonic() >= kills_until and len(self.kills) >= self.cfg.min_kills:
                if self.cfg.calm_tail_s and self.kills:
                    await self.pool_warmup()  # the restarted engines' pools
                    print(f"[{self.now():7.1f} s] calm tail: pools warmed up", flush=True)
                return
            victim = order[len(self.kills) % len(order)]
            waited_until = time.monotonic() + 10.0
            while (running := held(await asyncio.to_thread(self.baton.probe, victim))) < 1 \
                    and time.monotonic() < waited_until:
                await asyncio.sleep(0.05)  # a kill that disturbs a request
            pid = self.baton.pid_of(victim)
            if pid is None:
                raise RuntimeError(f"{victim} not running:\n{self.baton.tail()}")
            os.kill(pid, signal.SIGKILL)
            self.kills.append({"engine": victim, "pid": pid, "at_s": self.now(),
                               "held": running, "load_1min": os.getloadavg()[0]})
            print(f"[{self.now():7.1f} s] SIGKILL {victim} (pid {pid}, {running} held)",
                  flush=True)
            next_at = time.monotonic() + self.cfg.kill_every_s


# --------------------------------------------------------------------------- samples
class Sampler:
    """A thread: every `every_s` the RSS, fds and threads of the launcher, the router (and its
    worker processes) and each engine, and each engine's pool (a stats probe)."""

    def __init__(self, baton: BatonUp, t0: float, every_s: float) -> None:
        self.baton, self.t0, self.every_s = baton, t0, every_s
        self.samples: list[dict] = []
        self.pools: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def sample(self) -> None:
        at = round(time.monotonic() - self.t0, 2)
        children = self.baton.children()
        procs = [("launcher", psutil.Process(self.baton.proc.pid)), *children.items()]
        if "router" in children:  # its worker processes (multiprocessing) hold state too
            try:
                procs += [("router." + ("tracker" if "resource_tracker" in " ".join(
                    c.cmdline()) else "worker"), c) for c in children["router"].children()]
            except psutil.NoSuchProcess:
                pass
        for name, proc in procs:
            try:
                with proc.oneshot():
                    mem = proc.memory_info()  # shared: file-backed and shm pages (the weights'
                    # map, NIXL's segments); rss - shared is the private, anonymous heap
                    self.samples.append({"t": at, "name": name, "pid": proc.pid,
                                         "rss_mib": round(mem.rss / 2**20, 2),
                                         "anon_mib": round((mem.rss - mem.shared) / 2**20, 2),
                                         "fds": proc.num_fds(), "threads": proc.num_threads()})
            except psutil.NoSuchProcess:
                continue  # killed between the listing and the sample
        for engine in self.baton.engines:
            stats = self.baton.probe(engine, 2.0)
            if stats is not None:
                self.pools.append({
                    "t": at, "engine": engine, "free": stats.num_free_blocks,
                    "total": stats.num_total_blocks, "running": stats.num_running,
                    "leases": int(stats.extra.get("kv_leases_active", 0)),
                    "pulls": int(stats.extra.get("kv_pulls_active", 0)),
                    "written": _blocks_written(stats)})

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.sample()  # at rest


def _blocks_written(stats) -> int:
    """Blocks this engine process has written at least: KV pulled into fresh blocks (a
    completion engine), prompt tokens computed (a prompt engine). The plain free list hands out
    never-used blocks first, so once this reaches the pool's size every page of it is in RSS."""
    if stats.role == "completion":
        return int(stats.extra.get("kv_blocks_pulled", 0))
    return stats.num_prompt_tokens // 16


def without_largest_step(points: list[tuple[float, float]], span: int = 3
                         ) -> tuple[list[tuple[float, float]], float]:
    """The series with its largest rise over at most `span` sample intervals taken out (the
    samples inside it dropped, every later one lowered by it), and that rise. A one-time step
    (a heap's high-water mark raised once by the first batch bigger than any before: 38 MiB
    over two samples, 27 to 35 s, of a short soak's 44 s window, flat before and after) is not
    a leak; a leak grows on, over many intervals, and a few removed barely move its slope."""
    best = (0.0, 0, 0)
    for i in range(len(points)):
        for j in range(i + 1, min(i + span, len(points) - 1) + 1):
            best = max(best, (points[j][1] - points[i][1], i, j))
    rise, i, j = best
    if rise <= 0:
        return points, 0.0
    return points[:i + 1] + [(t, v - rise) for t, v in points[j:]], rise


def robust_slope_per_min(points: list[tuple[float, float]]) -> float:
    """Theil-Sen: the median of the pairwise slopes, per minute. A leak grows steadily and
    moves it; a one-time step near either end of the window does not, while it tilts a
    least-squares line over a short window. A step near the middle does (half the pairs
    straddle it), hence `without_largest_step` first."""
    slopes = sorted((v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(points)
                    for t2, v2 in points[i + 1:] if t2 > t1)
    return 60.0 * slopes[len(slopes) // 2] if slopes else 0.0


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute."""
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 60.0 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


def _growth(values: list[int]) -> int:
    """The median of the last third less the median of the first: a count that only wobbles
    (connections and workers come and go with the load) stays near 0."""
    third = len(values) // 3
    first, last = sorted(values[:third]), sorted(values[-third:])
    return last[len(last) // 2] - first[len(first) // 2]


def trends(samples: list[dict], cfg: SoakConfig, warmups: list[float],
           pools: list[dict]) -> list[dict]:
    """Per series (name, pid) that lived to the end: its RSS slope and fd/thread growth from
    warmup_s after the last pool warm-up of its life (a warm-up's big batches raise a heap's
    high-water mark once) and, an engine, after it has written every block of its pool (its
    first writes are RSS steps of a request's blocks); None where too little is left."""
    last_t = max(s["t"] for s in samples)
    series: dict[tuple[str, int], list[dict]] = {}
    for s in samples:
        series.setdefault((s["name"], s["pid"]), []).append(s)
    rows = []
    for (name, pid), points in series.items():
        start = points[0]["t"]
        is_engine = any(p["engine"] == name for p in pools)
        warmed = [w for w in warmups if w >= start]
        written = [p["t"] for p in pools if p["engine"] == name and p["t"] >= start
                   and p["written"] >= p["total"]]
        from_t = math.inf
        if warmed and (written or not is_engine):
            from_t = max(warmed[-1], written[0] if written else 0.0) + cfg.warmup_s
        settled = [p for p in points if p["t"] >= from_t]
        row = {"name": name, "pid": pid, "from_s": start, "to_s": points[-1]["t"],
               "survived": points[-1]["t"] == last_t, "samples": len(points),
               "judged_from_s": None if from_t == math.inf else round(from_t, 1),
               "rss_first_mib": points[0]["rss_mib"], "rss_last_mib": points[-1]["rss_mib"],
               "fds_first": points[0]["fds"], "fds_last": points[-1]["fds"],
               "threads_first": points[0]["threads"], "threads_last": points[-1]["threads"],
               "rss_slope_mib_min": None, "rss_lsq_slope_mib_min": None, "rss_step_mib": None,
               "anon_slope_mib_min": None, "fd_growth": None,
               "thread_growth": None}
        if row["survived"] and len(settled) >= 6 and settled[-1]["t"] - settled[0]["t"] >= 30:
            rss = [(p["t"], p["rss_mib"]) for p in settled]
            stepless, step = without_largest_step(rss)
            row["rss_slope_mib_min"] = round(robust_slope_per_min(stepless), 3)
            row["rss_lsq_slope_mib_min"] = round(slope_per_min(rss), 3)
            row["rss_step_mib"] = round(step, 2)
            if all("anon_mib" in p for p in settled):
                row["anon_slope_mib_min"] = round(robust_slope_per_min(without_largest_step(
                    [(p["t"], p["anon_mib"]) for p in settled])[0]), 3)
            row["fd_growth"] = _growth([p["fds"] for p in settled])
            row["thread_growth"] = _growth([p["threads"] for p in settled])
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- the run
def verdict(soak: Soak, rows: list[dict], whole_error: str, exits: list[str]) -> list[str]:
    """What failed (empty: the soak passed)."""
    cfg = soak.cfg
    problems = [f"{o.spec} {o.status} at {o.started_s} s: {o.detail}" for o in soak.outcomes
                if o.status in ("wrong", "failed")]
    if whole_error:
        problems.append(whole_error)
    expected_exits = [f"{k['engine']} exited (signal 9)" for k in soak.kills]
    if exits != expected_exits:
        problems.append(f"exits {exits} != the kills' {expected_exits}")
    for r in rows:
        if r["rss_slope_mib_min"] is not None and r["rss_slope_mib_min"] > cfg.max_rss_slope_mib_min:
            problems.append(f"{r['name']} (pid {r['pid']}) RSS grows "
                            f"{r['rss_slope_mib_min']} MiB/min")
        if r["fd_growth"] is not None and r["fd_growth"] > cfg.fd_tolerance:
            problems.append(f"{r['name']} (pid {r['pid']}) fds grew by {r['fd_growth']}")
        if r["thread_growth"] is not None and r["thread_growth"] > cfg.thread_tolerance:
            problems.append(f"{r['name']} (pid {r['pid']}) threads grew by {r['thread_growth']}")
    return problems


def _dash(value) -> str:
    return "-" if value is None else str(value)


def print_table(soak: Soak, rows: list[dict], restarts: list[float]) -> None:
    counts = Counter((o.spec.split("-")[0], o.status) for o in soak.outcomes)
    kinds = sorted({k for k, _ in counts})
    statuses = ("exact", "wrong", "failed", "aborted")
    print(f"\n{'kind':<12}" + "".join(f"{s:>9}" for s in statuses))
    for kind in kinds:
        print(f"{kind:<12}" + "".join(f"{counts[(kind, s)]:>9}" for s in statuses))
    print(f"{'all':<12}" + "".join(f"{sum(counts[(k, s)] for k in kinds):>9}" for s in statuses))
    print(f"\nkills: {len(soak.kills)}; restart to ready: {restarts} s")
    print(f"\n{'process':<14}{'pid':>8}{'from s':>8}{'judged':>8}{'samples':>8}{'RSS MiB':>16}"
          f"{'MiB/min TS / LSQ':>18}{'step':>7}{'fds':>10}{'+fds':>6}{'threads':>10}{'+thr':>6}")
    for r in rows:
        slope = f"{_dash(r['rss_slope_mib_min'])} / {_dash(r['rss_lsq_slope_mib_min'])}"
        judged = "-" if r["rss_slope_mib_min"] is None else f"{r['judged_from_s']:.0f}"
        print(f"{r['name']:<14}{r['pid']:>8}{r['from_s']:>8.0f}{judged:>8}{r['samples']:>8}"
              f"{r['rss_first_mib']:>8.1f}{r['rss_last_mib']:>8.1f}{slope:>18}"
              f"{_dash(r['rss_step_mib']):>7}"
              f"{r['fds_first']:>5}{r['fds_last']:>5}{_dash(r['fd_growth']):>6}"
              f"{r['threads_first']:>5}{r['threads_last']:>5}{_dash(r['thread_growth']):>6}")


def plot(path: Path, samples: list[dict], kills: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rss, ax_fds) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    series: dict[tuple[str, int], list[dict]] = {}
    for s in samples:
        series.setdefault((s["name"], s["pid"]), []).append(s)
    for (name, pid), points in sorted(series.items()):
        t = [p["t"] for p in points]
        ax_rss.plot(t, [p["rss_mib"] for p in points], label=f"{name} ({pid})")
        ax_fds.plot(t, [p["fds"] for p in points], label=f"{name} ({pid})")
    for k in kills:
        for ax in (ax_rss, ax_fds):
            ax.axvline(k["at_s"], color="grey", linestyle=":", linewidth=0.8)
    ax_rss.set_ylabel("RSS (MiB)")
    ax_fds.set_ylabel("open fds")
    ax_fds.set_xlabel("seconds since the load began (dotted: a SIGKILL)")
    ax_rss.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(cfg: SoakConfig) -> dict:
    key_dir = str(generate())
    up_args = ["--no-cpu-pinning", "--no-metrics", "--max-restarts", str(cfg.max_restarts()),
               "--restart-window", str(cfg.restart_window_s)]
    print(f"restart limit: --max-restarts {cfg.max_restarts()} --restart-window "
          f"{cfg.restart_window_s:g} (the supervisor's default, 5 per 600 s, would give up on an "
          f"engine killed every {cfg.kill_every_s:g} s)", flush=True)
    started = time.monotonic()
    try:
        baton = start_baton_up(cfg.num_prompt_engines, 2, ENGINE_FLAGS, up_args, key_dir)
    except BaseException:
        shutil.rmtree(key_dir, ignore_errors=True)
        raise
    up_s = time.monotonic() - started
    print(f"baton up ready in {up_s:.1f} s: {', '.join(baton.engines)}", flush=True)
    try:
        soak = Soak(cfg, baton)
        asyncio.run(soak.pool_warmup())
        asyncio.run(soak.references_run())
        print(f"references: {len(soak.references)} requests in "
              f"{time.monotonic() - started - up_s:.1f} s; the load runs {cfg.duration_s:g} s",
              flush=True)
        soak.t0, soak.warmups = time.monotonic(), [0.0]  # the load's t = 0: after the first
        sampler = Sampler(baton, soak.t0, cfg.sample_every_s)
        load_at_start = os.getloadavg()

        async def load_and_kills() -> None:
            stop_at = time.monotonic() + cfg.duration_s
            killer = asyncio.create_task(soak.killer(stop_at))
            try:
                await soak.load(stop_at, killer.done)
            finally:
                if not killer.done():
                    killer.cancel()
            await killer  # re-raises a failed kill

        asyncio.run(load_and_kills())
        load_at_end = os.getloadavg()
        whole_error = ""
        try:
            wait_back_and_whole(baton, soak.kills, cfg.quiesce_timeout_s)
        except AssertionError as exc:
            whole_error = f"not quiescent within {cfg.quiesce_timeout_s:g} s: {exc}"
        sampler.stop()
        exits = [m.group(0) for m in baton.stderr.matching(r"\S+ exited \([^)]*\)")]
        restarts = [float(m.group(1)) for m in
                    baton.stderr.matching(r"is back \(restart \d+ of \d+, ([\d.]+) s after")]
        rows = trends(sampler.samples, cfg, soak.warmups, sampler.pools)
        problems = verdict(soak, rows, whole_error, exits)
        print_table(soak, rows, restarts)
        result = {
            "config": {k: v for k, v in asdict(cfg).items() if k != "results_dir"},
            "up_s": round(up_s, 1), "load_avg_start": load_at_start, "load_avg_end": load_at_end,
            "requests": dict(Counter(o.status for o in soak.outcomes)),
            "outcomes": [asdict(o) for o in soak.outcomes], "kills": soak.kills,
            "restart_to_ready_s": restarts, "recoveries": recoveries(baton.base_url),
            "trends": rows, "warmups": soak.warmups, "samples": sampler.samples,
            "pools": sampler.pools,
            "passed": not problems, "problems": problems}
    finally:
        baton.stop()
        shutil.rmtree(key_dir, ignore_errors=True)
    cfg.results_dir.mkdir(parents=True, exist_ok=True)
    (cfg.results_dir / "soak.json").write_text(json.dumps(result, indent=1))
    plot(cfg.results_dir / "soak.png", sampler.samples, soak.kills)
    print(f"\nload average {load_at_start[0]:.1f} at the start, {load_at_end[0]:.1f} at the end; "
          f"recoveries {result['recoveries']}")
    print("PASS" if not problems else "FAIL:\n  " + "\n  ".join(problems[:30]), flush=True)
    return result


def parse_args(argv: list[str] | None) -> SoakConfig:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    d = SoakConfig()
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--kill-every", type=float, default=d.kill_every_s)
    p.add_argument("--sample-every", type=float, default=d.sample_every_s)
    p.add_argument("--warmup", type=float, default=d.warmup_s,
                   help="seconds after a process's pool warm-up left out of its trend")
    p.add_argument("--calm-tail", type=float, default=d.calm_tail_s,
                   help="the last seconds of load without kills (a pool warm-up opens them), "
                   "so that the restarted engines' trends can be told")
    p.add_argument("--min-kills", type=int, default=d.min_kills,
                   help="the load runs past --duration until this many kills are done")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--prompt-engines", type=int, default=d.num_prompt_engines,
                   help="1, or 2 (a spare: then every third kill hits a prompt engine)")
    p.add_argument("--restart-window", type=float, default=d.restart_window_s)
    p.add_argument("--max-rss-slope", type=float, default=d.max_rss_slope_mib_min,
                   help="MiB/min of RSS growth allowed to a process that survived")
    p.add_argument("--fd-tolerance", type=int, default=d.fd_tolerance)
    p.add_argument("--thread-tolerance", type=int, default=d.thread_tolerance)
    p.add_argument("--quiesce-timeout", type=float, default=d.quiesce_timeout_s)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--results-dir", type=Path, default=d.results_dir)
    a = p.parse_args(argv)
    try:
        return SoakConfig(
            duration_s=a.duration, kill_every_s=a.kill_every, sample_every_s=a.sample_every,
            warmup_s=a.warmup, calm_tail_s=a.calm_tail, concurrency=a.concurrency,
            min_kills=a.min_kills, num_prompt_engines=a.prompt_engines,
            restart_window_s=a.restart_window, max_rss_slope_mib_min=a.max_rss_slope,
            fd_tolerance=a.fd_tolerance, thread_tolerance=a.thread_tolerance,
            quiesce_timeout_s=a.quiesce_timeout, seed=a.seed, results_dir=a.results_dir)
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID`: where a long soak stands
    return 0 if run(parse_args(argv))["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
