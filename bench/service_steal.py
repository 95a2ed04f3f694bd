"""What a one-machine disaggregated fleet's router and client take from its engines' cores.

`baton up` on one machine runs the router, redis and the engines there, and a benchmark's
client beside them; each engine is pinned to a core of its own, the rest float. On a host with
as many cores as engines (this 2-core one, `bench/sim_validate.py`'s disaggregated points),
nothing is idle while both engines step, and the router's and the client's work for the
streams being decoded runs on the engines' cores. This measures it where it shows: one prompt
(`--prompt-words` random words, 2 tokens out) on the prompt engine, alone and beside k streams
decoding on the completion engine (each `--stream-tokens` tokens, streamed to this client), the
prefix cache reset before each, interleaved per prompt so the host's drift falls on every k.
Per prompt and k: the prompt step's time (the engine's `baton_engine_prompt_busy_seconds_total`),
the prompt engine's threads' time on a core and waiting for one (Linux schedstat: `run`, `wait`),
its busiest thread's alone (`loop`: the engine loop's, which runs the step), the completion
engine's threads' wait over the same window, and the router's and this client's
CPU seconds (psutil). Medians over the prompts, the step's ratio to alone (median of each
prompt's ratio) and its p10-p90. Prints a table, writes bench/results/service_steal.json.

    python bench/service_steal.py [--prompts 8] [--streams 0 1 4]

Linux only (schedstat). What the simulator makes of it: `baton profile` measures the router's
and a client's CPU per step and per token (`path.service_*_ms`), and `baton sim
--service-cores N` takes it from a host's busy engines (docs/profile.md, "Engines sharing a
host").
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil

from baton.ops.up_process import UpProcess
from baton.workload.fleet_metrics import SETTLE_S, scrape
from baton.workload.words import words
from simulator.calibrate import schedstat_ms, thread_schedstat_ms

RESULTS = Path(__file__).parent / "results" / "service_steal.json"
WARMUP_S = 0.8  # the streams decoding before the prompt is sent


def cpu_s(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


class Fleet:
    def __init__(self, up: UpProcess) -> None:
        self.url = up.base_url
        self.metrics_urls = list(up.metrics_urls.values())
        children = psutil.Process(up.proc.pid).children(recursive=True)

        def one(subcommand: str) -> psutil.Process:
            found = [c for c in children if subcommand in c.cmdline()]
            if len(found) != 1:
                raise SystemExit(f"expected one `baton {subcommand}` process, found {len(found)}")
            return found[0]

        self.prompt, self.completion = one("prompt-engine"), one("completion-engine")
        self.router = one("router")
        self.client = httpx.Client(base_url=self.url, timeout=120)
        self.model = self.client.get("/v1/models").raise_for_status().json()["data"][0]["id"]

    def prompt_busy_s(self) -> float:
        return sum(e.values.get("prefill_busy_s", 0.0)
                   for url in self.metrics_urls for e in scrape(url).values())

    def complete(self, prompt: str, max_tokens: int, client: httpx.Client | None = None) -> None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        with (client or self.client).stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for _ in r.iter_lines():
                pass

    def stream(self, max_tokens: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as client:
            self.complete("hello there", max_tokens, client)


def measure(fleet: Fleet, prompt: str, k: int, stream_tokens: int) -> dict:
    fleet.client.post("/reset_prefix_cache").raise_for_status()
    streams = [threading.Thread(target=fleet.stream, args=(stream_tokens,)) for _ in range(k)]
    for s in streams:
        s.start()
    time.sleep(WARMUP_S if k else 0.0)
    time.sleep(SETTLE_S)  # the engines publish their counters every 0.25 s
    busy0 = fleet.prompt_busy_s()
    # The prompt engine read once a side, thread by thread: its total is their sum.
    prompt0, c0 = thread_schedstat_ms(fleet.prompt.pid), schedstat_ms(fleet.completion.pid)
    cpu0, t0 = cpu_s([fleet.router, psutil.Process()]), time.perf_counter()
    fleet.complete(prompt, 2)
    wall = time.perf_counter() - t0
    prompt1, c1 = thread_schedstat_ms(fleet.prompt.pid), schedstat_ms(fleet.completion.pid)
    p0, p1 = sum(prompt0.values()), sum(prompt1.values())
    threads = {tid: ms - prompt0[tid] for tid, ms in prompt1.items() if tid in prompt0}
    loop = max(threads.values(), key=lambda ms: ms[0])  # the thread that ran the step
    cpu1 = cpu_s([fleet.router, psutil.Process()])
    time.sleep(SETTLE_S)
    busy1 = fleet.prompt_busy_s()
    for s in streams:
        s.join(timeout=300)
    return {"k": k, "step_ms": 1e3 * (busy1 - busy0), "prompt_run_ms": p1[0] - p0[0],
            "prompt_wait_ms": p1[1] - p0[1], "completion_wait_ms": c1[1] - c0[1],
            "loop_run_ms": float(loop[0]), "loop_wait_ms": float(loop[1]),
            "service_cores": (cpu1 - cpu0) / wall}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--streams", type=int, nargs="+", default=[0, 1, 4])
    p.add_argument("--stream-tokens", type=int, default=300)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("schedstat is Linux's: this benchmark runs there only")
    if 0 not in args.streams:
        args.streams = [0, *args.streams]  # the ratios are to the prompt alone
    up = UpProcess.start(["--prompt-engines", "1", "--completion-engines", "1", "--",
                          "--num-threads", "1", "--num-blocks", "512", "--max-num-seqs", "16",
                          "--max-num-batched-tokens", "1024"],
                         ready_timeout_s=600, keep_stderr=False)
    rows: list[dict] = []
    with up:
        fleet = Fleet(up)
        fleet.complete("warm up", 2)
        for i in range(args.prompts):
            prompt = words(random.Random(i), args.prompt_words)
            for k in args.streams:
                rows.append({"prompt": i, **measure(fleet, prompt, k, args.stream_tokens)})
            print(" ".join(f"k={r['k']}: {r['step_ms']:.0f} ms" for r in rows[-len(args.streams):]),
                  flush=True)
    alone = {r["prompt"]: r["step_ms"] for r in rows if r["k"] == 0}
    summary = []
    print(f"{'streams':>7}{'step ms':>9}{'x alone':>8}{'p10-p90':>12}{'P run':>8}{'P wait':>8}"
          f"{'loop run':>9}{'loop wait':>10}{'C wait':>8}{'router+client cores':>21}")
    for k in args.streams:
        mine = [r for r in rows if r["k"] == k]
        ratios = [r["step_ms"] / alone[r["prompt"]] for r in mine]
        s = {"k": k, "ratio": float(np.median(ratios)),
             "ratio_p10": float(np.percentile(ratios, 10)),
             "ratio_p90": float(np.percentile(ratios, 90)),
             **{key: float(np.median([r[key] for r in mine]))
                for key in ("step_ms", "prompt_run_ms", "prompt_wait_ms", "loop_run_ms",
                            "loop_wait_ms", "completion_wait_ms", "service_cores")}}
        summary.append(s)
        print(f"{k:>7}{s['step_ms']:>9.0f}{s['ratio']:>8.3f}"
              f"{s['ratio_p10']:>6.2f}-{s['ratio_p90']:<5.2f}{s['prompt_run_ms']:>8.0f}"
              f"{s['prompt_wait_ms']:>8.0f}{s['loop_run_ms']:>9.0f}{s['loop_wait_ms']:>10.0f}"
              f"{s['completion_wait_ms']:>8.0f}"
              f"{s['service_cores']:>21.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    record = {"args": {**vars(args), "out": Path(args.out).name},  # no path of this machine
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "summary": summary, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
