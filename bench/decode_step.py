"""Decode step time per mode (--quantization) at each batch and context, one process, modes
interleaved so a shared machine's load falls on all alike. A step: the mean of `steps` (64)
decode-only engine steps, timed after the batch's prompts are prefilled, for `batch` distinct
prompts of `context` tokens (64), greedy, 2 threads (--threads: the prompt steps'; a decode step takes
the engine's own count, one in the quantized modes, unless --decode-threads says). Prints a table (median ms per step, min-max over the repeats,
ratio to the first mode) and writes JSON.

    .venv/bin/python bench/decode_step.py [--modes none,int4] [--batches 1,8] [--repeats 5]
        [--steps 64] [--contexts 64]
        [--modes int4@avx2,int4@avx512]   # MODE@PATH: the block kernels through that path
        [--decode-kv pool,rows]   # each mode's fused decode op over the block pool / dense rows
        [--profile int4:1]   # also print torch.profiler's top ops for that mode and batch
        [--decode-threads 2]   # decode steps on 2 threads (EngineConfig.decode_threads)
        [--clock cpu]   # the process's CPU time, not the wall clock (with --decode-threads 1)

With --decode-kv, every mode runs once per source (`CPUBackend(decode_kv=...)`; a mode without
the fused op, the exact one, keeps its dense rows either way) and the table first gives what the
KV budget holds: tokens per GiB of --kv-cache-gb, float32 and bfloat16 KV, per mode and source.

`--clock cpu` times the process's CPU time instead of the wall clock: on a machine whose cores
other work shares, the time a step waited for a core is left out (what it lost to the others'
cache and memory traffic is not). Only with one decode thread (`--decode-threads 1`): a second
thread's spinning at a barrier would count as work.
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
CLOCK = [time.perf_counter]  # time.process_time with --clock cpu


def step_ms(engine, prompts: list[list[int]], steps: int) -> float:
    """Mean wall time of `steps` decode-only engine steps of the batch (prompts prefilled
    first, untimed: a prompt step's time is not a decode step's)."""
    from baton.sampling.params import SamplingParams

    # Room for the decode steps that run beside the later prompts' chunks (S40), then aborted.
    params = SamplingParams(temperature=0, max_tokens=steps + 400, ignore_eos=True)
    ids = {engine.add_request(None, p, params) for p in prompts}
    started: set[str] = set()
    while started != ids:  # until every prompt has its first token
        started |= {o.request_id for o in engine.step() if o.new_token_ids}
    start = CLOCK[0]()
    for _ in range(steps):
        assert not any(o.finished for o in engine.step()), "a request finished while timed"
    elapsed = CLOCK[0]() - start
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished():
        engine.step()
    return elapsed / steps * 1000


def profile(engine, prompts: list[list[int]]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from baton.sampling.params import SamplingParams

    with torch_profile(activities=[ProfilerActivity.CPU]) as p:
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=33, ignore_eos=True))
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def load(mode: str):
    """The weights of MODE or MODE@PATH (its quantized weights take kernel path PATH at load)."""
    from baton.model.loader import load_model
    from baton.model.quant import KERNEL_PATH_ENV

    quantization, _, path = mode.partition("@")
    before = os.environ.get(KERNEL_PATH_ENV)
    os.environ[KERNEL_PATH_ENV] = path or before or "auto"
    try:
        return load_model(device="cpu", quantization=quantization)
    finally:
        if before is None:
            del os.environ[KERNEL_PATH_ENV]
        else:
            os.environ[KERNEL_PATH_ENV] = before


def make_engine(mode: str, threads: int, loaded, decode_kv: str | None = None,
                kv_bytes: int = 512 * 2**20, kv_dtype: str = "auto", decode_threads: int = 0):
    """An engine for MODE on `loaded`; `decode_kv` "pool" / "rows": its backend's fused decode
    op reads the block pool / dense rows (None: the default backend); `decode_threads`: its
    decode steps' threads (0: the engine's default)."""
    from baton.engine import EngineConfig, LLMEngine
    from baton.model.backends import CPUBackend
    from baton.model.runner import build_runner

    config = EngineConfig(num_threads=threads, max_num_seqs=64, kv_cache_memory_bytes=kv_bytes,
                          quantization=mode.partition("@")[0], kv_cache_dtype=kv_dtype,
                          decode_threads=decode_threads)
    if decode_kv is None:  # the engine's own backend
        return LLMEngine(config, loaded=loaded)
    # the backend get_backend gives the mode, with this source
    backend = CPUBackend(fused_decode=loaded.quantization != "none", decode_kv=decode_kv)
    return LLMEngine(config, runner=build_runner(config, loaded, backend=backend))


def capacity(loaded: dict, sources: list[str | None], threads: int) -> list[dict]:
    """Tokens one GiB of KV budget holds, per mode, decode source and KV dtype (the engine's
    own sizing: the pool and whatever the backend keeps beside it)."""
    rows = []
    for mode, weights in loaded.items():
        for src in sources:
            for kv in ("float32", "bfloat16"):
                e = make_engine(mode, threads, weights, src, kv_bytes=2**30, kv_dtype=kv)
                rows.append({"mode": mode, "decode_kv": src or "default", "kv_dtype": kv,
                             "tokens_per_gib": e.runner.capacity_tokens,
                             "memory_factor": e.runner.backend.kv_memory_factor})
                del e
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="none,int4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--contexts", default="64", help="prompt tokens of each sequence")
    ap.add_argument("--decode-kv", default="", help="pool,rows: each mode over both sources")
    ap.add_argument("--kv-gib", type=float, default=0.5, help="each engine's KV budget")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-threads", type=int, default=0, help="0: the engine's default")
    ap.add_argument("--profile", default="", help="MODE:BATCH to profile after the runs")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.clock == "cpu":
        if args.decode_threads != 1:
            raise SystemExit("--clock cpu counts one decode thread's work: add --decode-threads 1")
        CLOCK[0] = time.process_time
    uptime_start = os.popen("uptime").read().strip()
    sources = args.decode_kv.split(",") if args.decode_kv else [None]
    loaded = {m: load(m) for m in args.modes.split(",")}
    caps = capacity(loaded, sources, args.threads) if args.decode_kv else []
    for c in caps:
        print(f"{c['mode']:>8} {c['decode_kv']:>5} {c['kv_dtype']:>9} KV: "
              f"{c['tokens_per_gib']:>7} tokens per GiB of KV budget")
    engines = {}
    for m, weights in loaded.items():
        for src in sources:
            name = m if src is None else f"{m}/{src}"
            engines[name] = make_engine(m, args.threads, weights, src, int(args.kv_gib * 2**30),
                                        decode_threads=args.decode_threads)
    modes = list(engines)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    text = "The history of computing is a story of people and machines. "
    base = engines[modes[0]].tokenizer.encode(text * (max(contexts) // 6 + 50))
    times: dict[tuple[str, int, int], list[float]] = {
        (m, b, c): [] for m in modes for b in batches for c in contexts}
    for c in contexts:
        for b in batches:
            prompts = [base[i:i + c] for i in range(b)]
            for m in modes:
                step_ms(engines[m], prompts, args.steps)  # warm-up
            for _ in range(args.repeats):
                for m in modes:
                    times[m, b, c].append(step_ms(engines[m], prompts, args.steps))
    rows = []
    print(f"uptime at start: {uptime_start}\nuptime at end:   {os.popen('uptime').read().strip()}")
    print(f"{'mode':>12} {'batch':>5} {'ctx':>5} {'ms/step':>8} {'min-max':>15} "
          f"{'vs ' + modes[0]:>8}")
    for c in contexts:
        for b in batches:
            ref = statistics.median(times[modes[0], b, c])
            for m in modes:
                t = times[m, b, c]
                med = statistics.median(t)
                rows.append({"mode": m, "batch": b, "context": c, "ms_per_step": med,
                             "min": min(t), "max": max(t), "runs": t,
                             "ratio_to_first": med / ref})
                print(f"{m:>12} {b:>5} {c:>5} {med:8.2f} {min(t):7.2f}-{max(t):7.2f} "
                      f"{med / ref:8.2f}")
    if args.profile:
        m, b = args.profile.split(":")
        profile(engines[m], [base[i:i + contexts[0]] for i in range(int(b))])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "decode_threads": args.decode_threads, "clock": args.clock,
        "load_avg": os.getloadavg(), "uptime_start": uptime_start,
        "uptime_end": os.popen("uptime").read().strip(),
        "steps": args.steps, "capacity": caps, "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
