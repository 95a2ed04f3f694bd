"""Running streams' inter-token latency during a burst of long prompts, per prefill cadence.

One NORMAL engine in this process (the default model, the servers' default mode): `--streams`
requests decode; then `--burst` long prompts arrive at once. With the seed's rule (S33 alone,
`--prefill-min-decode-steps 0`) the engine runs every prompt step of the burst back to back
while the streams wait; S40 puts `N` decode steps between two prompt steps. For each N the
table reports the streams' inter-token latency (p50 / p99 / max) from the burst's arrival until
its last prompt is prefilled (each stream's next token included), and the burst's time to first token (mean / max): what the
streams gain is what the burst pays.

    python bench/prefill_cadence.py --gaps 0,2,4,8 --repeats 3

Writes bench/results/prefill_cadence.json and prints ratios against N = 0 measured in the same
run (interleaved: each repeat runs every N once, in turn).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np


def run_once(engine_cls, config_cls, params_cls, loaded, gap: int, args) -> dict:
    engine = engine_cls(config_cls(quantization=args.quantization, num_threads=args.threads,
                                   max_num_batched_tokens=args.chunk,
                                   prefill_min_decode_steps=gap), loaded=loaded)
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    stream = params_cls(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)
    streams = [engine.add_request(None, rng.integers(100, vocab, 32).tolist(), stream)
               for _ in range(args.streams)]
    for _ in range(8):  # the streams are decoding
        engine.step()
    burst_params = params_cls(temperature=0, max_tokens=4, ignore_eos=True)
    start = time.perf_counter()
    burst = {engine.add_request(None, rng.integers(100, vocab, args.prompt_len).tolist(),
                                burst_params): None for _ in range(args.burst)}
    last = {rid: start for rid in streams}
    gaps: list[float] = []
    done_at = None  # when the burst's last prompt was prefilled
    # Until every stream has a token after that: its wait for the last prompt step counts.
    while done_at is None or any(t <= done_at for t in last.values()):
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in last and out.new_token_ids:
                gaps.append(now - last[out.request_id])
                last[out.request_id] = now
            elif out.request_id in burst and burst[out.request_id] is None and out.new_token_ids:
                burst[out.request_id] = now - start
        if done_at is None and all(t is not None for t in burst.values()):
            done_at = now
    for rid in [*streams, *burst]:
        engine.abort_request(rid)
    engine.step()
    assert engine.num_free_blocks() == engine.num_total_blocks()
    ttft = list(burst.values())
    return {"gap": gap, "itl_ms": [1000 * g for g in gaps], "ttft_ms": [1000 * t for t in ttft]}


def summarize(runs: list[dict]) -> dict:
    itl = [g for r in runs for g in r["itl_ms"]]
    ttft = [t for r in runs for t in r["ttft_ms"]]
    return {"itl_p50_ms": float(np.percentile(itl, 50)), "itl_p99_ms": float(np.percentile(itl, 99)),
            "itl_max_ms": float(max(itl)), "ttft_mean_ms": statistics.mean(ttft),
            "ttft_max_ms": max(ttft), "num_itl": len(itl),
            "itl_p99_per_repeat_ms": [float(np.percentile(r["itl_ms"], 99)) for r in runs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaps", default="0,2,4,8", help="values of --prefill-min-decode-steps")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=2000)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens (the CLI's)")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/prefill_cadence.json")
    args = ap.parse_args()
    import torch

    from baton.engine import EngineConfig, LLMEngine
    from baton.model.loader import load_model
    from baton.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_model(None, dtype="float32", quantization=args.quantization)
    gaps = [int(g) for g in args.gaps.split(",")]
    runs: dict[int, list[dict]] = {g: [] for g in gaps}
    for rep in range(args.repeats):
        for gap in gaps:
            runs[gap].append(run_once(LLMEngine, EngineConfig, SamplingParams, loaded, gap, args))
            print(f"repeat {rep + 1}/{args.repeats} gap {gap}: itl p99 "
                  f"{np.percentile(runs[gap][-1]['itl_ms'], 99):.0f} ms", flush=True)
    table = {g: summarize(r) for g, r in runs.items()}
    base = table[gaps[0]]
    print(f"\n{'min decode steps':>16} {'ITL p50':>9} {'ITL p99':>9} {'p99 ratio':>9} "
          f"{'ITL max':>9} {'burst TTFT mean':>15} {'TTFT ratio':>10}")
    for g, s in table.items():
        print(f"{g:>16} {s['itl_p50_ms']:>7.0f}ms {s['itl_p99_ms']:>7.0f}ms "
              f"{s['itl_p99_ms'] / base['itl_p99_ms']:>8.2f}x {s['itl_max_ms']:>7.0f}ms "
              f"{s['ttft_mean_ms']:>13.0f}ms {s['ttft_mean_ms'] / base['ttft_mean_ms']:>9.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "summary": table,
                               "load_average": list(__import__("os").getloadavg())}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
