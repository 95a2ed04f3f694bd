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

With --engine-metrics URL ... (the engines' /metrics URLs, as `baton up`'s banner prints them)
the record also gets a `fleet` section, the keys `baton sim` writes (per engine busy time,
steps, tokens, pulled KV, prefix-cache hit rate), from each engine's counters scraped before
and after the run (baton/workload/fleet_metrics.py); an engine that does not answer is noted
there, never a failed run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from baton.workload.args import (
    add_workload_arguments,
    build_specs,
    unit_arrivals,
    workload_from_args,
    workload_record,
)
from baton.workload.fleet_metrics import SETTLE_S, fleet_delta, format_fleet, scrape_all
from baton.workload.results import (  # noqa: F401 - the benchmark's names, as before
    SLO_KEYS,
    STAT_KEYS,
    RequestResult,
    format_table,
    meets_slos,
    parse_slos,
    stats_ms,
    summarize,
    write_result,
)
from baton.workload.synthetic import (  # noqa: F401
    DATASETS,
    STRUCTURED_SCHEMA,
    RequestSpec,
    WorkloadConfig,
    arrival_offsets,
    build_workload,
)
from baton.workload.trace import TraceConfig
from baton.workload.words import WORDS  # noqa: F401

logger = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# --------------------------------------------------------------------------- one request
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
    engine_metrics: list[str] = field(default_factory=list)  # the engines' /metrics URLs

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
    if spec.structured:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "items", "schema": STRUCTURED_SCHEMA}}
    return body


def _chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def _consume_stream(resp, cfg: BenchConfig, res: RequestResult, t0: float) -> None:
    """A stream is complete when its choice's finish_reason arrives, with or without text: a
    request's tokens may all decode to no text (special ids, skipped in the text), and the
    first one then shows only in the chunk that finishes it (its TTFT)."""
    last = None
    num_chunks = 0
    finished = False
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
        finished = finished or bool((chunk.get("choices") or [{}])[0].get("finish_reason"))
        if not text:
            if finished and last is None:  # every token came out as no text: TTFT at the end
                res.ttft_s, last = now - t0, now
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
    if not finished:
        raise RuntimeError("stream ended before its finish_reason" if num_chunks
                           else "stream ended without any text or finish_reason")


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
        offsets = unit_arrivals(list(units.values()), self.cfg.request_rate, seed)
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


async def run_async(cfg: BenchConfig, workload: WorkloadConfig,
                    trace: TraceConfig | None = None) -> dict:
    """Run one benchmark; returns the JSON-ready record (config, summary, per-request)."""
    import httpx

    specs = build_specs(workload, trace, cfg.num_requests)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.request_timeout_s)) as client:
        model = await _discover(client, cfg)
        ignore_eos = await _check_ignore_eos(client, cfg, model)
        before = await _scrape_engines(cfg)  # after the warm-up: it is not the run's
        t0 = time.perf_counter()
        results = await _Issuer(client, cfg, model, ignore_eos).run(specs, workload.seed)
        wall_s = time.perf_counter() - t0
    summary = summarize(results, wall_s, cfg.slos_ms)
    summary["ignore_eos"] = ignore_eos
    record = {"label": cfg.label, "model": model, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "bench": {**asdict(cfg), "api_key": "", "request_rate": _num(cfg.request_rate)},
              "workload": workload_record(workload, trace), "summary": summary,
              "requests": [asdict(r) for r in results]}
    if before is not None:
        record["fleet"] = fleet_delta(before, await _scrape_engines(cfg), wall_s)
    return record


async def _scrape_engines(cfg: BenchConfig):
    """The engines' counters (None without --engine-metrics), once the last answer's have been
    published (the engines publish them every 0.25 s)."""
    if not cfg.engine_metrics:
        return None
    await asyncio.sleep(SETTLE_S)
    return await scrape_all(cfg.engine_metrics)


def _num(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


# --------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's flags; shared by this script and `baton bench`."""
    d = BenchConfig()
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
    g.add_argument("--engine-metrics", nargs="+", default=[], metavar="URL",
                   help="the engines' Prometheus URLs (`baton up` prints them): scraped before "
                   "and after the run to fill the record's `fleet` section (busy time, tokens, "
                   "pulled KV, prefix-cache hit rate per engine)")
    add_workload_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument("--label", default="run", help="name in the table and the JSON file name")
    g.add_argument("--results-dir", default=str(RESULTS_DIR))
    g.add_argument("--no-progress", action="store_true")


def configs_from_args(args: argparse.Namespace,
                      ) -> tuple[BenchConfig, WorkloadConfig, TraceConfig | None]:
    import os

    bench = BenchConfig(
        base_url=args.base_url.rstrip("/"), endpoint=args.endpoint, model=args.model,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY", ""),
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        num_requests=args.num_requests, duration_s=args.duration,
        drain_timeout_s=args.drain_timeout, ignore_eos=not args.no_ignore_eos,
        slos_ms=parse_slos(args.goodput), label=args.label, progress=not args.no_progress,
        engine_metrics=list(args.engine_metrics))
    workload, trace = workload_from_args(args)
    return bench, workload, trace


def run(args: argparse.Namespace) -> int:
    """Entry point of `baton bench` and of this script."""
    try:
        bench, workload, trace = configs_from_args(args)
    except ValueError as exc:
        print(f"serve_bench: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    try:
        record = asyncio.run(run_async(bench, workload, trace))
    except OSError as exc:  # httpx's connection errors are OSErrors underneath, or wrap them
        print(f"serve_bench: cannot reach {bench.base_url}: {exc}", file=sys.stderr)
        return 1
    print(format_table(record))
    if record.get("fleet") and format_fleet(record["fleet"]):
        print(format_fleet(record["fleet"]))
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
