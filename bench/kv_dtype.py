"""The KV cache dtype: float32 (today's `auto`) against bfloat16, in one run.

    .venv/bin/python bench/kv_dtype.py                  # ~10 minutes on 2 busy cores
    .venv/bin/python bench/kv_dtype.py --modes int4 --rounds 5

Three parts, each float32 KV against bfloat16 KV on the same loaded weights:
  * capacity: tokens one GiB of `--kv-cache-gb` holds (the engine's own sizing: the pool and the
    CPU backend's decode rows together) and the bytes a completion engine pulls per prompt
    token (the registered pool's block bytes, what one NIXL descriptor of a block moves, over
    the block size);
  * quality gate: greedy continuations of `--quality-prompts` windows of held-out prose (the
    Python reference manual, which no test or prompt here uses; offsets and lengths fixed,
    not chosen by outcome) in the exact mode and the default int4 mode: how many are identical
    token for token, and where the first difference falls in the others;
  * c1 TPOT: one request at a time, decode steps timed, float32 and bfloat16 engines
    interleaved round by round (the machine's load falls on both alike); medians and spread.
Writes bench/results/kv_dtype.json and prints a table. Figures depend on the load: it is
recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "kv_dtype.json"
KV_DTYPES = ("float32", "bfloat16")
MODES = {"exact": "none", "int4": "auto"}
GIB = 2**30
THREADS = [2]  # each engine's torch threads (--threads)


def held_out_prompts(tokenizer, num: int) -> list[list[int]]:
    """`num` windows of held-out prose, lengths cycling over 24 / 96 / 240 / 480 tokens, at
    evenly spread offsets."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text)
    lengths = (24, 96, 240, 480)
    step = (len(ids) - max(lengths)) // num
    return [ids[i * step:i * step + lengths[i % len(lengths)]] for i in range(num)]


def engine(loaded, quantization: str, kv: str, **overrides):
    from baton.engine import EngineConfig, LLMEngine

    config = {"quantization": quantization, "kv_cache_dtype": kv, "num_blocks": 0,
              "kv_cache_memory_bytes": GIB // 4, "num_threads": THREADS[0], **overrides}
    return LLMEngine(EngineConfig(**config), loaded=loaded)


def capacity(loaded, quantization: str) -> dict[str, dict]:
    from kv_transfer.config import PoolSpec

    out = {}
    for kv in KV_DTYPES:
        e = engine(loaded, quantization, kv, kv_cache_memory_bytes=GIB)
        spec = PoolSpec.of(e.kv_cache)
        out[kv] = {"blocks_per_gib": e.num_total_blocks(),
                   "tokens_per_gib": (e.num_total_blocks() - 1) * e.config.block_size,
                   "block_bytes": spec.block_bytes,
                   "pull_bytes_per_token": spec.block_bytes / e.config.block_size}
    return out


def quality(loaded, quantization: str, prompts: list[list[int]], max_tokens: int) -> dict:
    from baton.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = {}
    for kv in KV_DTYPES:
        e = engine(loaded, quantization, kv)
        outs[kv] = [o.token_ids for o in e.generate(prompts, params)]
    firsts = []
    for a, b in zip(outs["float32"], outs["bfloat16"], strict=True):
        diff = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if diff is not None:
            firsts.append(diff)
    same = sum(a == b for a, b in zip(outs["float32"], outs["bfloat16"], strict=True))
    tokens = sum(len(a) for a in outs["float32"])
    agree = sum(x == y for a, b in zip(outs["float32"], outs["bfloat16"], strict=True)
                for x, y in zip(a, b, strict=True))
    return {"prompts": len(prompts), "identical": same, "first_difference_at": sorted(firsts),
            "token_agreement": agree / tokens, "prompt_lengths": [len(p) for p in prompts]}


def tpot(loaded, quantization: str, prompt: list[int], tokens: int, rounds: int) -> dict:
    """Per-token decode time of one request alone (after its first token), interleaved."""
    from baton.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engines = {kv: engine(loaded, quantization, kv) for kv in KV_DTYPES}
    samples: dict[str, list[float]] = {kv: [] for kv in KV_DTYPES}
    for r in range(rounds + 1):  # round 0 warms up
        for kv, e in engines.items():
            e.add_request(f"r{r}", prompt, params)
            first = None
            while e.has_unfinished():
                for out in e.step():
                    if first is None and out.new_token_ids:
                        first = time.perf_counter()
            if r:
                samples[kv].append((time.perf_counter() - first) / (tokens - 1) * 1e3)
            e.reset_prefix_cache()  # every round prefills afresh
    return {kv: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v),
                 "samples_ms": v} for kv, v in samples.items()}


PARTS = {"capacity": capacity, "quality": quality, "tpot_c1": tpot}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quality-prompts", type=int, default=12)
    p.add_argument("--quality-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="TPOT rounds per dtype")
    p.add_argument("--threads", type=int, default=2, help="each engine's torch threads")
    p.add_argument("--tpot-tokens", type=int, default=32)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    p.add_argument("--out", default=str(RESULTS), help="the JSON file to write")
    args = p.parse_args()
    out_path = Path(args.out)
    THREADS[0] = args.threads
    import torch

    from baton.model import load_model

    load_before = os.getloadavg()
    result = {"load_avg_before": load_before, "args": vars(args), "modes": {}}
    for mode in args.modes:
        torch.set_num_threads(args.threads)
        loaded = load_model(quantization=MODES[mode], device="cpu")
        prompts = held_out_prompts(loaded.tokenizer, args.quality_prompts)
        parts = result["modes"][mode] = {}
        extras = {"capacity": (), "quality": (prompts, args.quality_tokens),
                  "tpot_c1": (prompts[1], args.tpot_tokens, args.rounds)}
        for name in args.parts:
            run, extra = PARTS[name], extras[name]
            t0 = time.perf_counter()
            parts[name] = run(loaded, MODES[mode], *extra)
            # Written after every part: a long run stopped early keeps what it measured.
            result["load_avg_after"] = os.getloadavg()
            out_path.parent.mkdir(exist_ok=True)
            out_path.write_text(json.dumps(result, indent=2) + "\n")
            print(f"{mode} {name}: {time.perf_counter() - t0:.0f} s, load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    print(f"load avg before {load_before[0]:.1f}, after {result['load_avg_after'][0]:.1f}")
    print("| mode | KV dtype | tokens / GiB | pull bytes / token | c1 TPOT ms median [min-max] |")
    print("|---|---|---:|---:|---|")
    for mode, m in result["modes"].items():
        for kv in KV_DTYPES:
            c = m.get("capacity", {}).get(kv, {})
            t = m.get("tpot_c1", {}).get(kv)
            tpot_text = f"{t['median_ms']:.1f} [{t['min_ms']:.1f}-{t['max_ms']:.1f}]" if t else "-"
            print(f"| {mode} | {kv} | {c.get('tokens_per_gib', '-')} | "
                  f"{c.get('pull_bytes_per_token', '-')} | {tpot_text} |")
    for mode, m in result["modes"].items():
        if "quality" not in m:
            continue
        q = m["quality"]
        print(f"quality {mode}: {q['identical']}/{q['prompts']} greedy continuations identical,"
              f" token agreement {100 * q['token_agreement']:.1f}%, first differences at "
              f"{q['first_difference_at']}")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
