"""Decode step time per mode (--quantization) at each batch, one process, modes interleaved so a
shared machine's load falls on all alike. A step: (prefill + steps + 1 tokens) minus (prefill + 1
token), over `steps` steps (64), for `batch` distinct 64-token prompts, greedy, 2 threads. Prints a table
(median ms per step, min-max over the repeats, ratio to the first mode) and writes JSON.

    .venv/bin/python bench/decode_step.py [--modes none,int4] [--batches 1,8] [--repeats 5]
        [--steps 64]
        [--modes int4@avx2,int4@avx512]   # MODE@PATH: the block kernels through that path
        [--profile int4:1]   # also print torch.profiler's top ops for that mode and batch
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "decode_step.json"


def step_ms(engine, prompts: list[list[int]], steps: int) -> float:
    from baton.sampling.params import SamplingParams

    def run(n: int) -> float:
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    return (run(steps + 1) - run(1)) / steps * 1000


def profile(engine, prompts: list[list[int]]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from baton.sampling.params import SamplingParams

    with torch_profile(activities=[ProfilerActivity.CPU]) as p:
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=33, ignore_eos=True))
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def make_engine(mode: str, threads: int):
    """An engine for MODE or MODE@PATH (its quantized weights take kernel path PATH at load)."""
    from baton.engine import EngineConfig, LLMEngine
    from baton.model.quant import KERNEL_PATH_ENV

    quantization, _, path = mode.partition("@")
    before = os.environ.get(KERNEL_PATH_ENV)
    os.environ[KERNEL_PATH_ENV] = path or before or "auto"
    try:
        return LLMEngine(EngineConfig(num_threads=threads, max_num_seqs=64,
                                      kv_cache_memory_bytes=512 * 2**20, quantization=quantization))
    finally:
        if before is None:
            del os.environ[KERNEL_PATH_ENV]
        else:
            os.environ[KERNEL_PATH_ENV] = before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="none,int4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", default="", help="MODE:BATCH to profile after the runs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    modes = args.modes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    engines = {m: make_engine(m, args.threads) for m in modes}
    base = engines[modes[0]].tokenizer.encode(
        "The history of computing is a story of people and machines. " * 50)
    times: dict[tuple[str, int], list[float]] = {(m, b): [] for m in modes for b in batches}
    for b in batches:
        prompts = [base[i:i + 64] for i in range(b)]
        for m in modes:
            step_ms(engines[m], prompts, args.steps)  # warm-up
        for _ in range(args.repeats):
            for m in modes:
                times[m, b].append(step_ms(engines[m], prompts, args.steps))
    rows = []
    print(f"{'mode':>12} {'batch':>5} {'ms/step':>8} {'min-max':>15} {'vs ' + modes[0]:>8}")
    for b in batches:
        ref = statistics.median(times[modes[0], b])
        for m in modes:
            t = times[m, b]
            med = statistics.median(t)
            rows.append({"mode": m, "batch": b, "ms_per_step": med, "min": min(t), "max": max(t),
                         "runs": t, "ratio_to_first": med / ref})
            print(f"{m:>12} {b:>5} {med:8.2f} {min(t):7.2f}-{max(t):7.2f} {med / ref:8.2f}")
    if args.profile:
        m, b = args.profile.split(":")
        profile(engines[m], [base[i:i + 64] for i in range(int(b))])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "load_avg": os.getloadavg(), "steps": args.steps, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
