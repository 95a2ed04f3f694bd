"""Prefill attention: one padded call for several chunks against one call per chunk.

Per case (chunks as num_new+num_cached tokens), one layer of SmolLM2's attention shapes
(9 query heads, 3 KV heads, head_dim 64) over a real pool layout: the time of
`prefill_attention` with every chunk alone (the loop) and with the pack the heuristic picks,
and with every chunk forced into the pack. Medians of --repeats runs, interleaved, and the
p10-p90 spread. Then, per case, a whole engine step (LLMEngine, 30 layers, prefix caching off,
cached prefixes made by an earlier step) with the heuristic vs the loop (the step's whole time, what a user waits). Prints a table and
writes bench/results/prefill_attention.json.

    python bench/prefill_attention_bench.py [--threads 2] [--repeats 30]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from baton.model.backends import cpu_prefill as cp

RESULTS = Path(__file__).parent / "results" / "prefill_attention.json"
CASES = {  # name -> [(num_new, num_cached)] per chunk
    "8x64": [(64, 0)] * 8,
    "8x64+64cached": [(64, 64)] * 8,
    "4x256": [(256, 0)] * 4,
    "16x32+96cached": [(32, 96)] * 16,
    "1x1024+7x64": [(1024, 0)] + [(64, 0)] * 7,
    "1x512+512cached+7x64": [(512, 512)] + [(64, 0)] * 7,
}
HQ, HKV, D, B = 9, 3, 64, 16


def make_case(chunks: list[tuple[int, int]]):
    """A pool holding every chunk's context, the step's q/k/v and its slices."""
    num_blocks = 1 + sum(-(-(q + c) // B) for q, c in chunks)
    pool = torch.randn(num_blocks, 2, B, HKV, D)
    width = max(-(-(q + c) // B) for q, c in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    nxt = 1
    for i, (q, c) in enumerate(chunks):
        nb = -(-(q + c) // B)
        tables[i, :nb] = torch.arange(nxt, nxt + nb)
        nxt += nb
    seqlens_q = np.array([q for q, _ in chunks])
    seqlens_k = np.array([q + c for q, c in chunks])
    starts = np.concatenate([[0], np.cumsum(seqlens_q)[:-1]]).astype(np.int64)
    num_tokens = int(seqlens_q.sum())
    q = torch.randn(num_tokens, HQ, D)
    kv = torch.stack([pool[tables[i, (c + j) // B], :, (c + j) % B]
                      for i, (n, c) in enumerate(chunks) for j in range(n)])
    slices = cp.build_slices(seqlens_q, seqlens_k, starts, tables, B)
    return q, kv[:, 0], kv[:, 1], pool, slices, num_tokens


def time_attention(chunks, repeats: int) -> dict:
    q, k, v, pool, slices, num_tokens = make_case(chunks)
    batches = {"loop": cp.PrefillBatch(slices, None),
               "all packed": cp.PrefillBatch([], cp.build_packed(slices, B, num_tokens))}
    lone, group = cp.split_pack(slices)
    batches["heuristic"] = cp.PrefillBatch(lone, cp.build_packed(group, B, num_tokens)
                                           if group else None)
    out = torch.empty_like(q)
    ref = torch.empty_like(q)
    cp.prefill_attention(q, k, v, pool, batches["loop"], ref)
    times: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(repeats):
        for name, batch in batches.items():
            t0 = time.perf_counter()
            cp.prefill_attention(q, k, v, pool, batch, out)
            times[name].append(time.perf_counter() - t0)
            assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4), name
    return {"num_packed": len(group), "waste": cp._waste(slices),
            **{name: _stats(ts) for name, ts in times.items()}}


def _stats(ts: list[float]) -> dict:
    ms = np.asarray(ts) * 1e3
    return {"median_ms": float(np.median(ms)), "p10_ms": float(np.percentile(ms, 10)),
            "p90_ms": float(np.percentile(ms, 90))}


def time_step(engine, chunks, repeats: int, rng: np.random.Generator) -> dict:
    """One engine step prefilling the case's new tokens (`generate`, max_tokens 1; the cached
    parts computed by an untimed `generate` of the prefixes before), heuristic vs loop (every
    chunk alone), interleaved; fresh random prompts each time so nothing else is cached."""
    from baton.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1)
    times: dict[str, list[float]] = {"loop": [], "heuristic": []}
    limit = cp._PACK_MAX_WASTE
    try:
        for _ in range(repeats):
            for name, waste in (("loop", 0.0), ("heuristic", limit)):
                prompts = [rng.integers(100, 40000, q + c).tolist() for q, c in chunks]
                prefixes = [p[:c] for p, (_, c) in zip(prompts, chunks, strict=True) if c]
                if prefixes:
                    engine.generate(prefixes, params)
                cp._PACK_MAX_WASTE = waste
                t0 = time.perf_counter()
                engine.generate(prompts, params)
                times[name].append(time.perf_counter() - t0)
                cp._PACK_MAX_WASTE = limit
    finally:
        cp._PACK_MAX_WASTE = limit
    return {name: _stats(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--step-repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from baton.engine import EngineConfig, LLMEngine
    from baton.sampling.params import SamplingParams

    engine = LLMEngine(EngineConfig(num_threads=args.threads, kv_cache_memory_bytes=2**30))
    rng = np.random.default_rng(0)
    engine.generate([rng.integers(100, 40000, 64).tolist()] * 2,
                    SamplingParams(max_tokens=1))  # warm-up
    rows = []
    for name, chunks in CASES.items():
        rows.append({"case": name, "attention": time_attention(chunks, args.repeats),
                     "step": time_step(engine, chunks, args.step_repeats, rng)})
        print(name, json.dumps(rows[-1]), flush=True)
    print(f"{'case':<22}{'packed':>7}{'waste':>6} | {'attention ms: loop':>19}{'heuristic':>10}"
          f"{'ratio':>6}{'all-pack':>9} | {'step ms: loop':>14}{'heuristic':>10}{'ratio':>6}")
    for r in rows:
        a, s = r["attention"], r["step"]
        print(f"{r['case']:<22}{a['num_packed']:>7}{a['waste']:>6.2f} | "
              f"{a['loop']['median_ms']:>19.3f}{a['heuristic']['median_ms']:>10.3f}"
              f"{a['heuristic']['median_ms'] / a['loop']['median_ms']:>6.2f}"
              f"{a['all packed']['median_ms']:>9.3f} | {s['loop']['median_ms']:>14.1f}"
              f"{s['heuristic']['median_ms']:>10.1f}"
              f"{s['heuristic']['median_ms'] / s['loop']['median_ms']:>6.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "repeats": args.repeats,
                                          "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
