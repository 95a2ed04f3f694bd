"""What KV integrity costs per prompt: block checksums on (`--kv-checksum all`) against off.

    .venv/bin/python bench/kv_integrity_bench.py [--runs 5] [--tokens 128 512 1024 2048]

For prompts of --tokens tokens (the default model's KV: SmolLM2-135M, float32, 16 tokens a
block = 737,280 bytes a block), in one run:
- producer: the exporter's hold() of the prompt's blocks (lease + CRC-32 of every block, the
  time a prompt engine's step loop spends before the handle leaves), checksum on and off;
  baseline: the prefill of the same prompt on the default model (an LLMEngine, one request,
  max_tokens 1, --threads torch threads), the step that hold() follows.
- consumer: a whole pull (claim, NIXL READ on the same-host path, verification of every block)
  from an exporter process, checksums on and off, interleaved (on, off, off, on, ...) so load
  drift hits both alike.
Medians and spread (min..max) of --runs; writes bench/results/kv_integrity.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
MODEL_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M fp32: 737,280 bytes per block
KV_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
MODES = ("all", "off")


def _fingerprint():
    from kv_transfer import Fingerprint

    return Fingerprint("SmolLM2-135M", "float32", 30, 3, 64, 16)


def _stats(values: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(values), "min_ms": 1e3 * min(values),
            "max_ms": 1e3 * max(values), "n": len(values)}


def _exporter_main(conn, num_blocks: int) -> None:
    """One exporter per checksum mode over one pool; answers hold(ids) with (handle, seconds)."""
    os.environ.update(KV_ENV)
    from kv_transfer import KVExporter, TransferConfig

    pool = np.random.default_rng(0).integers(0, 255, (num_blocks, MODEL_BLOCK), dtype=np.uint8)
    exporters = {m: KVExporter(pool, TransferConfig(checksum=m), _fingerprint(),
                               lambda r, b: None, f"bench-{m}") for m in MODES}
    conn.send(True)
    while True:
        cmd, *args = conn.recv()
        if cmd != "hold":
            break
        mode, request_id, ids = args
        exp = exporters[mode]
        end = time.monotonic() + 5  # the previous pull's release note may be in flight
        while exp.num_leases() and time.monotonic() < end:
            time.sleep(0.001)
        start = time.perf_counter()
        handle = exp.hold(request_id, ids, num_tokens=16 * len(ids))
        conn.send((handle, time.perf_counter() - start))
    for exp in exporters.values():
        exp.close()
    conn.send(True)


def transfer_side(tokens: list[int], runs: int) -> dict:
    """hold() and pull times per prompt length and mode, interleaved."""
    os.environ.update(KV_ENV)
    from kv_transfer import KVImporter, TransferConfig, TransferState

    num_blocks = max(tokens) // 16 + 2
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_exporter_main, args=(child, num_blocks), daemon=True)
    proc.start()
    assert conn.poll(60), "exporter did not start"
    conn.recv()
    pool = np.ones((num_blocks, MODEL_BLOCK), dtype=np.uint8)
    importer = KVImporter(pool, TransferConfig(), _fingerprint(), "bench-c")
    out: dict = {}
    try:
        for n in tokens:
            ids = list(range(1, -(-n // 16) + 1))
            hold = {m: [] for m in MODES}
            pull = {m: [] for m in MODES}
            order = [m for i in range(runs + 1) for m in (MODES if i % 2 else MODES[::-1])]
            for i, mode in enumerate(order):
                conn.send(("hold", mode, f"{mode}-{n}-{i}", ids))
                handle, held_s = conn.recv()
                result = importer.transfer(handle, ids)
                assert result.state == TransferState.DONE, result
                if i >= len(MODES):  # the first pair warms the handshake and UCX
                    hold[mode].append(held_s)
                    pull[mode].append(result.seconds)
            out[n] = {"blocks": len(ids), "hold": {m: _stats(v) for m, v in hold.items()},
                      "pull": {m: _stats(v) for m, v in pull.items()}}
    finally:
        importer.close()
        conn.send(("exit",))
        proc.join(10)
    return out


def prefill_side(tokens: list[int], runs: int, threads: int) -> dict:
    """The default model's prefill of each prompt length (max_tokens 1): the baseline."""
    import torch

    torch.set_num_threads(threads)
    from baton.engine import EngineConfig, LLMEngine
    from baton.sampling.params import SamplingParams

    engine = LLMEngine(EngineConfig(num_threads=threads, enable_prefix_caching=False,
                                    quantization="none", max_model_len=max(tokens) + 16,
                                    kv_cache_memory_bytes=2**30))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.generate([rng.integers(300, 40000, 32).tolist()], params)  # warm-up
    out = {}
    for n in tokens:
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            engine.generate([rng.integers(300, 40000, n).tolist()], params)
            times.append(time.perf_counter() - start)
        out[n] = _stats(times)
        print(f"prefill {n}: {out[n]['median_ms']:.0f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the prefill")
    ap.add_argument("--prefill-runs", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "kv_integrity.json"))
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    transfer = transfer_side(args.tokens, args.runs)
    prefill = prefill_side(args.tokens, args.prefill_runs, args.threads)
    report = {"host": platform.node(), "cpus": os.cpu_count(), "block_bytes": MODEL_BLOCK,
              "runs": args.runs, "threads": args.threads,
              "load_avg_1m": [load_before, os.getloadavg()[0]], "rows": []}
    print(f"load average (1 min) {load_before:.1f} -> {os.getloadavg()[0]:.1f}; "
          "ms, median (min..max)")
    print(f"{'tokens':>6} {'blocks':>6} | {'hold all':>18} {'hold off':>8} | {'prefill':>8} "
          f"{'+%':>5} | {'pull all':>18} {'pull off':>8} {'+ms':>6}")
    for n in args.tokens:
        t, p = transfer[n], prefill[n]
        hold_added = t["hold"]["all"]["median_ms"] - t["hold"]["off"]["median_ms"]
        pull_added = t["pull"]["all"]["median_ms"] - t["pull"]["off"]["median_ms"]
        row = {"tokens": n, **t, "prefill": p, "hold_added_ms": hold_added,
               "hold_added_vs_prefill": hold_added / p["median_ms"], "pull_added_ms": pull_added}
        report["rows"].append(row)
        h, u = t["hold"]["all"], t["pull"]["all"]
        print(f"{n:>6} {t['blocks']:>6} | {h['median_ms']:>6.2f} ({h['min_ms']:.2f}.."
              f"{h['max_ms']:.2f}) {t['hold']['off']['median_ms']:>8.2f} | "
              f"{p['median_ms']:>8.0f} {100 * row['hold_added_vs_prefill']:>5.1f} | "
              f"{u['median_ms']:>6.2f} ({u['min_ms']:.2f}..{u['max_ms']:.2f}) "
              f"{t['pull']['off']['median_ms']:>8.2f} {pull_added:>6.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
