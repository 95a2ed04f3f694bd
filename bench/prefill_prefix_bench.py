"""A prompt chunk behind a cached prefix: the shifted mask against the square causal problem.

A prefix-cache hit (a conversation's next turn, a shared system prompt) leaves the step's chunk
behind cached tokens. The CPU backend ran it through SDPA with a causal mask shifted by the
cached length, which torch computes at every query-key pair's price; from 512 new tokens behind
a prefix of at most a quarter of them it now runs the square causal problem over the whole
context, zero queries standing for the cached positions (baton/model/backends/cpu_prefill.py
`PrefillSlice.square`), where SDPA skips the blocks past the diagonal. Per case (new tokens,
cached tokens): one layer of SmolLM2's attention shapes (9 query heads, 3 KV heads, head_dim 64)
with the square path off and on, interleaved, --repeats times; then a whole engine step
(LLMEngine, the default model, prefix caching on, the prefix computed by an untimed request
before) off and on, interleaved, --step-repeats times. Medians and the p10-p90 spread; the
outputs of the two paths are checked equal (to float rounding). Prints a table and writes
bench/results/prefill_prefix.json.

    python bench/prefill_prefix_bench.py [--threads 1] [--repeats 20] [--step-repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_attention_bench import _stats, make_case  # noqa: E402 - a sibling script

from baton.model.backends import cpu_prefill as cp  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "prefill_prefix.json"
CASES = [(1024, 16), (1024, 256), (768, 128), (545, 16), (512, 64), (256, 16), (1024, 512)]
_ON = cp._SQUARE_MIN_Q
_OFF = 1 << 30  # a `_SQUARE_MIN_Q` no chunk reaches: the shifted mask everywhere


def _path(square: bool) -> None:
    cp._SQUARE_MIN_Q = _ON if square else _OFF


def time_attention(case: tuple[int, int], repeats: int) -> dict:
    q, k, v, pool, slices, _ = make_case([case])
    batch = cp.PrefillBatch(slices, None)
    outs = {name: torch.empty_like(q) for name in ("mask", "square")}
    times: dict[str, list[float]] = {name: [] for name in outs}
    try:
        for _ in range(repeats):
            for name, out in outs.items():
                _path(name == "square")
                t0 = time.perf_counter()
                cp.prefill_attention(q, k, v, pool, batch, out)
                times[name].append(time.perf_counter() - t0)
    finally:
        _path(True)
    assert torch.allclose(outs["mask"], outs["square"], atol=2e-6, rtol=1e-5), case
    return {"runs_square": slices[0].square, **{name: _stats(ts) for name, ts in times.items()}}


def time_step(engine, case: tuple[int, int], repeats: int, rng: np.random.Generator) -> dict:
    from baton.sampling.params import SamplingParams

    new, cached = case
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times: dict[str, list[float]] = {"mask": [], "square": []}
    try:
        for _ in range(repeats):
            for name in times:
                prompt = rng.integers(100, 40000, new + cached).tolist()
                engine.generate([prompt[:cached]], params)
                _path(name == "square")
                t0 = time.perf_counter()
                out = engine.generate([prompt], params)[0]
                times[name].append(time.perf_counter() - t0)
                assert out.num_cached_tokens == cached, (case, out.num_cached_tokens)
    finally:
        _path(True)
    return {name: _stats(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--step-repeats", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from baton.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(num_threads=args.threads, decode_threads=args.threads,
                                    enable_prefix_caching=True, max_num_batched_tokens=2048))
    rng = np.random.default_rng(0)
    rows = []
    for case in CASES:
        rows.append({"new": case[0], "cached": case[1],
                     "attention": time_attention(case, args.repeats),
                     "step": time_step(engine, case, args.step_repeats, rng)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"{'new':>5}{'cached':>7}{'square':>7} | {'layer ms: mask':>15}{'square':>8}"
          f"{'ratio':>6} | {'step ms: mask':>14}{'square':>8}{'ratio':>6}  p10-p90 (step)")
    for r in rows:
        a, s = r["attention"], r["step"]
        print(f"{r['new']:>5}{r['cached']:>7}{str(a['runs_square']):>7} | "
              f"{a['mask']['median_ms']:>15.2f}{a['square']['median_ms']:>8.2f}"
              f"{a['square']['median_ms'] / a['mask']['median_ms']:>6.2f} | "
              f"{s['mask']['median_ms']:>14.0f}{s['square']['median_ms']:>8.0f}"
              f"{s['square']['median_ms'] / s['mask']['median_ms']:>6.2f}  "
              f"{s['mask']['p10_ms']:.0f}-{s['mask']['p90_ms']:.0f} / "
              f"{s['square']['p10_ms']:.0f}-{s['square']['p90_ms']:.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "repeats": args.repeats,
                                          "step_repeats": args.step_repeats,
                                          "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
