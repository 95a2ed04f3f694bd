"""Open-loop serving benchmark against any OpenAI-compatible endpoint.

One run: build a seeded workload (prompts of real words, so a prompt of N words is about N
tokens in any BPE vocabulary), send it with Poisson arrivals at a given rate or at a fixed
concurrency, stream every answer, and time each token's arrival. Reports request and output
token throughput, TTFT, TPOT, ITL, end-to-end latency (mean, median, p90, p99) and goodput
under SLOs; prints a table and writes bench/results/serve_<label>_<time>.json.

    python bench/serve_bench.py --base-url http://127.0.0.1:8000 --dataset mix \
        --num-requests 40 --request-rate 0.5 --goodput ttft:3000 tpot:250
    baton bench ...   # the same flags

A run is bounded: it stops issuing after --num-requests or --duration seconds, waits at most
--drain-timeout for the requests in flight, and records the rest as cancelled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
STAT_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
SLO_KEYS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2e": "e2e_ms"}

# Common English nouns and adjectives; each is exactly one token after a space in SmolLM2's
# GPT-2 style vocabulary (checked with its tokenizer), and one or two in other BPE vocabularies.
WORDS = """time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work government
number night point home water room mother area money story fact month lot right study book eye
job word business issue side kind head house service friend father power hour game line end
member law car city community name president team minute idea kid body information back parent
face level office door health person art war history party result change morning reason research
girl moment air teacher force education foot boy age policy process music market sense nation plan
college interest death experience effect class control care field development role effort rate
heart show leader light voice wife police mind price report decision son view relationship town
road arm difference value building action model season society tax director position player
record paper space ground form event official matter center couple site project activity star
table need court oil situation cost industry figure street image phone data picture practice piece
land product doctor wall patient worker news test movie north love support technology step baby
computer type attention film tree source organization hair window evidence population truth song
river garden bridge summer winter spring autumn green blue red small large quick slow bright dark
happy early late""".split()


# --------------------------------------------------------------------------- workload
DATASETS = ("fixed", "uniform", "mix", "multi-turn", "shared-prefix")


@dataclass
class WorkloadConfig:
    # fixed: every request input_len/output_len; uniform: lengths drawn from the ranges;
    # mix: chat traffic (short_* ranges) with a long_fraction of long prompts among it;
    # multi-turn: conversations of `turns` turns behind one shared system prompt of
    # system_prompt_len words, each turn's prompt the conversation so far plus a new user
    # message (short_* ranges), sent when the previous answer is complete;
    # shared-prefix: independent requests, each behind one of num_system_prompts system prompts.
    dataset: str = "mix"
    input_len: int = 64
    output_len: int = 96
    input_range: tuple[int, int] = (32, 256)
    output_range: tuple[int, int] = (32, 128)
    short_input_range: tuple[int, int] = (56, 72)  # "~64 tokens" chat prompts
    short_output_range: tuple[int, int] = (64, 128)
    long_fraction: float = 0.1
    long_input_range: tuple[int, int] = (1400, 1600)  # "~1500 tokens" documents
    long_output_range: tuple[int, int] = (16, 32)
    turns: int = 6  # multi-turn: turns per conversation (num_requests counts conversations)
    system_prompt_len: int = 512  # multi-turn, shared-prefix: words of each system prompt
    num_system_prompts: int = 4  # shared-prefix
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.turns < 1 or self.num_system_prompts < 1 or self.system_prompt_len < 0:
            raise ValueError(f"turns and num_system_prompts must be >= 1 and system_prompt_len "
                             f">= 0, got {self.turns}/{self.num_system_prompts}/"
                             f"{self.system_prompt_len}")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {self.long_fraction}")
        for name in ("input_range", "output_range", "short_input_range", "short_output_range",
                     "long_input_range", "long_output_range"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {lo}:{hi}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input_len/output_len must be >= 1, got "
                             f"{self.input_len}/{self.output_len}")


@dataclass
class RequestSpec:
    idx: int
    kind: str  # "fixed" | "uniform" | "short" | "long": metrics are also reported per kind
    prompt: str  # the user message
    num_prompt_words: int
    max_tokens: int
    system: str = ""  # a system message before it ("" = none)
    conversation: int = -1  # multi-turn: the conversation and turn of this request
    turn: int = 0


def _lengths(cfg: WorkloadConfig, rng: random.Random) -> tuple[str, int, int]:
    if cfg.dataset == "fixed":
        return "fixed", cfg.input_len, cfg.output_len
    if cfg.dataset == "uniform":
        return "uniform", rng.randint(*cfg.input_range), rng.randint(*cfg.output_range)
    if rng.random() < cfg.long_fraction:
        return "long", rng.randint(*cfg.long_input_range), rng.randint(*cfg.long_output_range)
    return "short", rng.randint(*cfg.short_input_range), rng.randint(*cfg.short_output_range)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_workload(cfg: WorkloadConfig, num_requests: int) -> list[RequestSpec]:
    """The same seed gives the same prompts and lengths, whatever the rate or the server.
    multi-turn: `num_requests` conversations of `cfg.turns` turns, in conversation order."""
    rng = random.Random(cfg.seed)
    if cfg.dataset == "multi-turn":
        system = _words(rng, cfg.system_prompt_len)
        specs = []
        for conv in range(num_requests):
            for turn in range(cfg.turns):
                num_in = rng.randint(*cfg.short_input_range)
                specs.append(RequestSpec(len(specs), "turn", _words(rng, num_in), num_in,
                                         rng.randint(*cfg.short_output_range), system, conv,
                                         turn))
        return specs
    systems = [_words(rng, cfg.system_prompt_len) for _ in range(cfg.num_system_prompts)]
    specs = []
    for idx in range(num_requests):
        if cfg.dataset == "shared-prefix":
            num_in = rng.randint(*cfg.short_input_range)
            specs.append(RequestSpec(idx, "shared", _words(rng, num_in), num_in,
                                     rng.randint(*cfg.short_output_range), rng.choice(systems)))
            continue
        kind, num_in, num_out = _lengths(cfg, rng)
        specs.append(RequestSpec(idx, kind, _words(rng, num_in), num_in, num_out))
    return specs


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after start at which each request is sent: Poisson process, or all at 0."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed + 7919)  # its own stream: the prompts do not depend on the rate
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --------------------------------------------------------------------------- one request
@dataclass
class RequestResult:
    idx: int
    kind: str
    ok: bool = False
    error: str = ""
    start_s: float = 0.0  # since the run's start
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    prompt_tokens: int = 0  # from the server's usage when it sends one, else words
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when the server says
    output_tokens: int = 0
    expected_output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)  # gaps between successive text chunks
    text: str = ""  # the answer (multi-turn: the next turn's history)

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 \
            else 0.0


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "chat"  # chat -> /v1/chat/completions, completions -> /v1/completions
    model: str = ""  # "" = the first of GET /v1/models
    api_key: str = ""
    request_rate: float = math.inf  # requests/s, Poisson; inf = all at once (see concurrency)
    max_concurrency: int = 0  # > 0: at most this many in flight (inf rate = fixed concurrency)
    num_requests: int = 40
    duration_s: float = 0.0  # > 0: stop issuing after this many seconds
    drain_timeout_s: float = 120.0  # after issuing stops, wait this long for stragglers
    request_timeout_s: float = 600.0
    ignore_eos: bool = True  # send vLLM's ignore_eos extension (dropped if the server refuses)
    slos_ms: dict[str, float] = field(default_factory=dict)  # ttft/tpot/e2e -> milliseconds
    label: str = "run"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be chat or completions, got {self.endpoint!r}")
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 (inf for all at once), got "
                             f"{self.request_rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.max_concurrency < 0 or self.duration_s < 0:
            raise ValueError("max_concurrency and duration_s must be >= 0")
        unknown = set(self.slos_ms) - set(SLO_KEYS)
        if unknown:
            raise ValueError(f"unknown SLO {sorted(unknown)}; known: {sorted(SLO_KEYS)}")


def _payload(cfg: BenchConfig, spec: RequestSpec, model: str, ignore_eos: bool,
             history: list[dict] | None = None) -> dict:
    """`history`: the conversation's earlier user and assistant messages (multi-turn)."""
    body: dict = {"model": model, "max_tokens": spec.max_tokens, "temperature": 0.0,
                  "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    messages = [{"role": "system", "content": spec.system}] if spec.system else []
    messages += [*(history or []), {"role": "user", "content": spec.prompt}]
    if cfg.endpoint == "chat":
        body["messages"] = messages
    else:  # the completions endpoint has no roles: the turns one after another
        body["prompt"] = "\n\n".join(m["content"] for m in messages)
    return body


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def _consume_stream(resp, cfg: BenchConfig, res: RequestResult, t0: float) -> None:
    last = None
    num_chunks = 0
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("error"):
            raise RuntimeError(f"stream error: {chunk['error']}")
        now = time.perf_counter()
        if chunk.get("usage"):
            usage = chunk["usage"]
            res.prompt_tokens = usage.get("prompt_tokens", res.prompt_tokens)
            res.output_tokens = usage.get("completion_tokens", 0)
            res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        text = _chunk_text(chunk, cfg.endpoint)
        if not text:
            continue
        res.text += text
        num_chunks += 1
        if last is None:
            res.ttft_s = now - t0
        else:
            res.itl_s.append(now - last)
        last = now
    res.e2e_s = time.perf_counter() - t0
    res.output_tokens = res.output_tokens or num_chunks  # no usage: one chunk ~ one token
    if num_chunks == 0:
        raise RuntimeError("stream ended without any text")


async def send_request(client, cfg: BenchConfig, spec: RequestSpec, model: str,
                       ignore_eos: bool, run_t0: float,
                       history: list[dict] | None = None) -> RequestResult:
    """Stream one request; never raises: failures are recorded in the result."""
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    res = RequestResult(spec.idx, spec.kind, prompt_tokens=spec.num_prompt_words,
                        expected_output_tokens=spec.max_tokens)
    t0 = time.perf_counter()
    res.start_s = t0 - run_t0
    try:
        async with client.stream("POST", path, json=_payload(cfg, spec, model, ignore_eos, history)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {r.status_code}: {body}")
            await _consume_stream(r, cfg, res, t0)
        res.ok = True
    except asyncio.CancelledError:
        res.error = "cancelled at the time limit"
    except Exception as exc:  # noqa: BLE001 - any failure is one failed request, not a crash
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res


# --------------------------------------------------------------------------- the run
class Progress:
    """tqdm when it is installed, else one plain stderr line redrawn in place."""

    def __init__(self, total: int, enabled: bool, label: str) -> None:
        self.total, self.done, self.enabled, self.label = total, 0, enabled, label
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=label, file=sys.stderr, leave=False)
            except ImportError:
                pass

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif self.enabled:
            print(f"\r{self.label}: {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


async def _discover(client, cfg: BenchConfig) -> str:
    import httpx

    if cfg.model:
        return cfg.model
    try:
        r = await client.get("/v1/models")
    except httpx.TransportError as exc:
        raise ConnectionError(f"{type(exc).__name__}: {exc}") from exc
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def _check_ignore_eos(client, cfg: BenchConfig, model: str) -> bool:
    """One short warm-up request; it also tells whether the server takes `ignore_eos`."""
    if not cfg.ignore_eos:
        return False
    probe = RequestSpec(-1, "warmup", "hello world", 2, 2)
    res = await send_request(client, cfg, probe, model, True, time.perf_counter())
    if res.ok:
        return True
    logger.warning("server refused ignore_eos (%s); relying on max_tokens, outputs may be short",
                   res.error)
    return False


class _Issuer:
    """Sends the workload on its arrival schedule and bounds the run.

    Issuing stops after the last request or at the --duration deadline (requests still waiting
    for a concurrency slot then are never sent); the requests in flight get --drain-timeout
    more seconds, counted from the deadline or from the last send, and are then cancelled.
    """

    def __init__(self, client, cfg: BenchConfig, model: str, ignore_eos: bool) -> None:
        self.client, self.cfg, self.model, self.ignore_eos = client, cfg, model, ignore_eos
        self.gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.run_t0 = time.perf_counter()
        self.deadline = self.run_t0 + cfg.duration_s if cfg.duration_s else math.inf
        self.num_passed = 0  # sent or skipped at the deadline
        self.last_send = self.run_t0
        self.sent: set[int] = set()  # request indices actually sent

    async def one(self, spec: RequestSpec, progress: Progress,
                  history: list[dict] | None = None) -> RequestResult | None:
        try:
            if self.gate is None:
                return await self._send(spec, history)
            async with self.gate:
                return await self._send(spec, history)
        finally:
            progress.update()

    async def _send(self, spec: RequestSpec, history: list[dict] | None) -> RequestResult | None:
        self.num_passed += 1
        if time.perf_counter() >= self.deadline:
            return None
        self.last_send = time.perf_counter()
        self.sent.add(spec.idx)
        return await send_request(self.client, self.cfg, spec, self.model, self.ignore_eos,
                                  self.run_t0, history)

    async def conversation(self, turns: list[RequestSpec], progress: Progress) -> None:
        """Send the turns one after another, each with the answers so far; a failed turn
        ends its conversation (its later turns are not sent)."""
        history: list[dict] = []
        for spec in turns:
            res = await self.one(spec, progress, history)
            if res is None:
                return
            self.results[spec.idx] = res
            if not res.ok:
                return
            history += [{"role": "user", "content": spec.prompt},
                        {"role": "assistant", "content": res.text}]

    async def run(self, specs: list[RequestSpec], seed: int) -> list[RequestResult]:
        """Arrivals are per conversation (a single request is a conversation of one turn)."""
        units: dict[int, list[RequestSpec]] = {}
        for spec in specs:
            units.setdefault(spec.conversation if spec.conversation >= 0 else -1 - spec.idx,
                             []).append(spec)
        self.num_specs = len(specs)
        self.results: dict[int, RequestResult] = {}
        offsets = arrival_offsets(len(units), self.cfg.request_rate, seed)
        progress = Progress(len(specs), self.cfg.progress, self.cfg.label)
        tasks: list[asyncio.Task] = []
        for unit, offset in zip(units.values(), offsets, strict=True):
            if self.run_t0 + offset >= self.deadline:
                break  # the time limit ends issuing; what is in flight may still finish
            delay = self.run_t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(self.conversation(unit, progress)))
        await self._drain(tasks)
        progress.close()
        return [self.results.get(spec.idx) or
                RequestResult(spec.idx, spec.kind, error="cancelled at the time limit")
                for spec in specs if spec.idx in self.sent]

    async def _drain(self, tasks: list[asyncio.Task]) -> None:
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=0.25)
            issued_until = self.deadline if self.num_passed < self.num_specs else \
                min(self.deadline, self.last_send)
            if pending and time.perf_counter() >= issued_until + self.cfg.drain_timeout_s:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending)
                return


async def run_async(cfg: BenchConfig, workload: WorkloadConfig) -> dict:
    """Run one benchmark; returns the JSON-ready record (config, summary, per-request)."""
    import httpx

    specs = build_workload(workload, cfg.num_requests)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.request_timeout_s)) as client:
        model = await _discover(client, cfg)
        ignore_eos = await _check_ignore_eos(client, cfg, model)
        t0 = time.perf_counter()
        results = await _Issuer(client, cfg, model, ignore_eos).run(specs, workload.seed)
        wall_s = time.perf_counter() - t0
    summary = summarize(results, wall_s, cfg.slos_ms)
    summary["ignore_eos"] = ignore_eos
    return {"label": cfg.label, "model": model, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "bench": {**asdict(cfg), "api_key": "", "request_rate": _num(cfg.request_rate)},
            "workload": asdict(workload), "summary": summary,
            "requests": [asdict(r) for r in results]}


def _num(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


# --------------------------------------------------------------------------- metrics
def stats_ms(values_s: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds (zeros when there is nothing to measure)."""
    import numpy as np

    if not values_s:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0, "count": 0}
    a = np.asarray(values_s) * 1000.0
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
            "count": int(a.size)}


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    value_ms = {"ttft": r.ttft_s * 1e3, "tpot": r.tpot_s * 1e3, "e2e": r.e2e_s * 1e3}
    return r.ok and all(value_ms[k] <= limit for k, limit in slos_ms.items())


def latency_stats(ok: list[RequestResult]) -> dict[str, dict[str, float]]:
    return {"ttft_ms": stats_ms([r.ttft_s for r in ok]),
            "tpot_ms": stats_ms([r.tpot_s for r in ok if r.output_tokens > 1]),
            "itl_ms": stats_ms([x for r in ok for x in r.itl_s]),
            "e2e_ms": stats_ms([r.e2e_s for r in ok])}


def summarize(results: list[RequestResult], wall_s: float, slos_ms: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    num_out = sum(r.output_tokens for r in ok)
    good = [r for r in ok if meets_slos(r, slos_ms)]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    kinds = sorted({r.kind for r in ok})
    return {
        "num_issued": len(results), "num_completed": len(ok), "num_failed": len(results) - len(ok),
        "errors": errors, "duration_s": wall_s,
        "num_short_outputs": sum(r.output_tokens < r.expected_output_tokens for r in ok),
        "total_prompt_tokens": sum(r.prompt_tokens for r in ok), "total_output_tokens": num_out,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "cached_token_fraction": (sum(r.cached_tokens for r in ok)
                                  / max(1, sum(r.prompt_tokens for r in ok))),
        "request_throughput": len(ok) / wall_s if wall_s else 0.0,
        "output_throughput": num_out / wall_s if wall_s else 0.0,
        "slos_ms": slos_ms, "num_good": len(good),
        "goodput": len(good) / wall_s if wall_s else 0.0,
        **latency_stats(ok),
        "by_kind": {k: {"count": sum(r.kind == k for r in ok),
                        **latency_stats([r for r in ok if r.kind == k])} for k in kinds},
    }


def format_table(record: dict) -> str:
    s = record["summary"]
    slos = " ".join(f"{k}<={v:g}ms" for k, v in s["slos_ms"].items()) or "none"
    lines = [
        f"== {record['label']}: {record['model']} ({record['bench']['endpoint']}, "
        f"rate {record['bench']['request_rate']}/s, {record['workload']['dataset']}) ==",
        f"completed {s['num_completed']}/{s['num_issued']} in {s['duration_s']:.1f}s "
        f"(failed {s['num_failed']}, short outputs {s['num_short_outputs']})",
        f"request throughput {s['request_throughput']:.3f} req/s   "
        f"output {s['output_throughput']:.1f} tok/s   "
        f"goodput {s['goodput']:.3f} req/s ({s['num_good']} met SLOs: {slos})   "
        f"cached prompt tokens {s['total_cached_tokens']} ({100 * s['cached_token_fraction']:.0f}%)",
        f"{'metric (ms)':<12}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}",
    ]
    for key in STAT_KEYS:
        st = s[key]
        lines.append(f"{key[:-3].upper():<12}{st['mean']:>10.1f}{st['median']:>10.1f}"
                     f"{st['p90']:>10.1f}{st['p99']:>10.1f}")
    for err, n in s["errors"].items():
        lines.append(f"  {n} x {err}")
    return "\n".join(lines)


def write_result(record: dict, results_dir: Path = RESULTS_DIR) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"serve_{record['label']}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


# --------------------------------------------------------------------------- command line
def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or N, got {text!r}") from None


def _slos(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS or not value:
            raise ValueError(f"bad --goodput item {item!r}: expected ttft:MS, tpot:MS or e2e:MS")
        out[key] = float(value)
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags; shared by this script and `baton bench`."""
    d, w = BenchConfig(), WorkloadConfig()
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default=d.base_url, help="server root (without /v1)")
    g.add_argument("--endpoint", default=d.endpoint, choices=["chat", "completions"])
    g.add_argument("--model", default="", help="model name (default: the first of /v1/models)")
    g.add_argument("--api-key", default="", help="bearer key (default: $OPENAI_API_KEY)")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send the ignore_eos extension")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s with Poisson arrivals (default inf: all at once)")
    g.add_argument("--max-concurrency", type=int, default=0,
                   help="cap on requests in flight; with an infinite rate, a fixed concurrency")
    g.add_argument("--num-requests", type=int, default=d.num_requests)
    g.add_argument("--duration", type=float, default=0.0, help="stop issuing after S seconds")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s,
                   help="seconds to wait for requests in flight once issuing stops")
    g.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                   help="SLOs a good request meets, e.g. ttft:3000 tpot:250 e2e:20000")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default=w.dataset, choices=list(DATASETS))
    g.add_argument("--turns", type=int, default=w.turns,
                   help="multi-turn: turns per conversation (--num-requests conversations)")
    g.add_argument("--system-prompt-len", type=int, default=w.system_prompt_len,
                   help="multi-turn, shared-prefix: words of each system prompt")
    g.add_argument("--num-system-prompts", type=int, default=w.num_system_prompts,
                   help="shared-prefix: how many system prompts the requests share")
    g.add_argument("--seed", type=int, default=w.seed)
    g.add_argument("--input-len", type=int, default=w.input_len, help="fixed: prompt words")
    g.add_argument("--output-len", type=int, default=w.output_len, help="fixed: output tokens")
    for name, default in (("input-range", w.input_range), ("output-range", w.output_range),
                          ("short-input-range", w.short_input_range),
                          ("short-output-range", w.short_output_range),
                          ("long-input-range", w.long_input_range),
                          ("long-output-range", w.long_output_range)):
        g.add_argument(f"--{name}", type=_range, default=default, metavar="LO:HI")
    g.add_argument("--long-fraction", type=float, default=w.long_fraction,
                   help="mix: share of long prompts among the chat traffic")
    g = p.add_argument_group("output")
    g.add_argument("--label", default="run", help="name in the table and the JSON file name")
    g.add_argument("--results-dir", default=str(RESULTS_DIR))
    g.add_argument("--no-progress", action="store_true")


def configs_from_args(args: argparse.Namespace) -> tuple[BenchConfig, WorkloadConfig]:
    import os

    bench = BenchConfig(
        base_url=args.base_url.rstrip("/"), endpoint=args.endpoint, model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY", ""),
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        num_requests=args.num_requests, duration_s=args.duration,
        drain_timeout_s=args.drain_timeout, ignore_eos=not args.no_ignore_eos,
        slos_ms=_slos(args.goodput), label=args.label, progress=not args.no_progress)
    workload = WorkloadConfig(
        dataset=args.dataset, seed=args.seed, input_len=args.input_len,
        output_len=args.output_len, input_range=args.input_range, output_range=args.output_range,
        short_input_range=args.short_input_range, short_output_range=args.short_output_range,
        long_fraction=args.long_fraction, long_input_range=args.long_input_range,
        long_output_range=args.long_output_range, turns=args.turns,
        system_prompt_len=args.system_prompt_len, num_system_prompts=args.num_system_prompts)
    return bench, workload


def run(args: argparse.Namespace) -> int:
    """Entry point of `baton bench` and of this script."""
    try:
        bench, workload = configs_from_args(args)
    except ValueError as exc:
        print(f"serve_bench: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        record = asyncio.run(run_async(bench, workload))
    except OSError as exc:  # httpx's connection errors are OSErrors underneath, or wrap them
        print(f"serve_bench: cannot reach {bench.base_url}: {exc}", file=sys.stderr)
        return 1
    print(format_table(record))
    path = write_result(record, Path(args.results_dir))
    print(f"wrote {path}")
    return 0 if record["summary"]["num_completed"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
