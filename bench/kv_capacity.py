"""What one GiB of KV budget holds: tokens per GiB of `kv_cache_memory_bytes` (`--kv-cache-gb`)
per KV dtype and decode K/V source, as the engine sizes its pool (the runner's own sizing: the
pool and whatever the backend keeps beside it, `Backend.kv_memory_factor`).

    .venv/bin/python bench/kv_capacity.py [--modes int4 exact] [--gib 1]

Rows: float32 KV over dense decode rows (the int4 mode before `--decode-kv pool` was its default:
half the budget holds each decoding sequence's K/V a second time), bfloat16 KV over rows, and
bfloat16 / float32 KV over the pool (the budget holds unique blocks only); the exact mode keeps
its rows whatever `decode_kv` says. Each runner is built on the loaded weights, its pool mapped
but never touched, so the figures are the engine's, not arithmetic beside it. Prints a table,
writes bench/results/kv_capacity.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "kv_capacity.json"
GIB = 2**30
MODES = {"int4": "auto", "exact": "none"}  # the servers' default mode, the quality reference
# (KV dtype, decode K/V source): the first is the baseline the ratios are to.
CASES = (("float32", "rows"), ("bfloat16", "rows"), ("float32", "pool"), ("bfloat16", "pool"))


def measure(loaded, quantization: str, kv_dtype: str, decode_kv: str, budget: int) -> dict:
    from baton.engine import EngineConfig
    from baton.model.runner import build_runner

    config = EngineConfig(quantization=quantization, kv_cache_dtype=kv_dtype,
                          decode_kv=decode_kv, kv_cache_memory_bytes=budget, num_blocks=0)
    runner = build_runner(config, loaded)
    factor = runner.backend.kv_memory_factor
    return {"kv_dtype": kv_dtype, "decode_kv": decode_kv,
            "reads_pool": bool(getattr(runner.backend, "pool_decode", False)),
            "memory_factor": factor, "num_blocks": runner.num_blocks,
            "block_bytes": runner.kv_spec.bytes_per_block,
            "tokens": runner.capacity_tokens,
            "tokens_per_gib": runner.capacity_tokens * GIB / budget}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["int4"], choices=list(MODES))
    p.add_argument("--gib", type=float, default=1.0, help="the KV budget of each runner")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    from baton.engine import EngineConfig
    from baton.model import load_model

    budget = int(args.gib * GIB)
    rows = []
    for mode in args.modes:
        loaded = load_model(quantization=MODES[mode], device="cpu")
        for kv_dtype, decode_kv in CASES:
            rows.append({"mode": mode, **measure(loaded, MODES[mode], kv_dtype, decode_kv,
                                                 budget)})
        del loaded
    base = {r["mode"]: r["tokens_per_gib"] for r in rows
            if (r["kv_dtype"], r["decode_kv"]) == CASES[0]}
    print(f"KV budget {args.gib:g} GiB per runner; EngineConfig.decode_kv default: "
          f"{EngineConfig.decode_kv!r}")
    print("| mode | KV dtype | decode K/V | beside the pool | blocks | tokens / GiB | vs float32 rows |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        r["ratio_to_float32_rows"] = r["tokens_per_gib"] / base[r["mode"]]
        source = r["decode_kv"] if r["reads_pool"] or r["decode_kv"] == "rows" else "rows (kept)"
        print(f"| {r['mode']} | {r['kv_dtype']} | {source} | +{100 * r['memory_factor']:.0f}% | "
              f"{r['num_blocks']} | {r['tokens_per_gib']:.0f} | "
              f"{r['ratio_to_float32_rows']:.2f}x |")
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"budget_gib": args.gib, "decode_kv_default": EngineConfig.decode_kv,
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
