"""Speculative decoding (n-gram drafts): c1 time per output token with and without, per workload.

One NORMAL engine in this process started with `--speculative ngram` (the servers' default
mode otherwise); the baseline is the same engine with the request field `speculative=False`,
so both run on the same process, weights and threads. Each repeat runs every (workload,
speculation) pair once, in turn (interleaved), one request at a time (c1), greedy:
  copy    the prompt is a passage followed by its first sentences again: the model goes on
          copying it (the output mostly repeats the prompt)
  random  random token ids, sampled at temperature 1 with a seed, ignore_eos: nothing in the
          prompt to copy, and sampled text rarely repeats itself (greedy decoding of this
          135M model falls into loops, which drafts catch)
Both paths must produce the same tokens (greedy; seeded sampling draws per output position):
the benchmark checks it on every pair.
TPOT = (last token's time - first token's) / (tokens - 1), per request; the table gives its
median and spread over the repeats, the ratio on/off of the medians, and the drafts' acceptance.

    python bench/spec_decode.py --repeats 5

Writes bench/results/spec_decode.json. State the machine's load (`uptime`) with any figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

PASSAGE = (
    "Paged attention stores the key and value cache of every sequence in fixed-size blocks, "
    "so that memory is allocated on demand and shared between requests. A scheduler decides "
    "at every step which sequences run: prompts are prefilled, possibly in chunks, and running "
    "sequences decode one token at a time. When the pool runs out of blocks, the youngest "
    "sequence is preempted and later recomputed from its prompt and the tokens it already "
    "produced. Disaggregated serving goes one step further: prefill runs on one machine, decode "
    "on another, and the cache moves between them over RDMA. ")


def workloads(tokenizer, vocab: int, prompt_len: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    return {"copy": tokenizer.encode(PASSAGE + PASSAGE[:200]),
            "random": rng.integers(100, vocab, prompt_len).tolist()}


WORKLOAD_SAMPLING = {"copy": {"temperature": 0.0}, "random": {"temperature": 1.0, "seed": 0}}


def run_request(engine, prompt: list[int], params) -> tuple[float, list[int]]:
    """(TPOT in seconds, tokens) of one request run alone."""
    rid = engine.add_request(None, prompt, params)
    times: list[float] = []
    tokens: list[list[int]] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                times.append(time.perf_counter())
                tokens.append(out.new_token_ids)
    num = sum(len(t) for t in tokens)
    return (times[-1] - times[0]) / (num - len(tokens[0])), [t for ts in tokens for t in ts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="random workload's prompt")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "spec_decode.json"))
    args = ap.parse_args()

    import torch

    from baton.engine import EngineConfig, LLMEngine
    from baton.model import load_model
    from baton.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_model(quantization=args.quantization, device="cpu")
    engine = LLMEngine(EngineConfig(quantization=args.quantization, num_threads=args.threads,
                                    speculative="ngram",
                                    num_speculative_tokens=args.num_speculative_tokens),
                       loaded=loaded)
    prompts = workloads(loaded.tokenizer, engine.model_config.vocab_size, args.prompt_len)
    tpot: dict[tuple[str, bool], list[float]] = {}
    accept: dict[str, list[int]] = {name: [0, 0] for name in prompts}
    outputs: dict[str, list[int]] = {}
    for name, prompt in prompts.items():  # warm-up: each path once
        for spec in (False, True):
            run_request(engine, prompt, SamplingParams(max_tokens=16, ignore_eos=True,
                                                       speculative=spec,
                                                       **WORKLOAD_SAMPLING[name]))
    for _ in range(args.repeats):
        for name, prompt in prompts.items():
            for spec in (False, True):
                stats = engine.speculator.stats
                before = (stats.num_drafted, stats.num_accepted)
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                        speculative=spec, **WORKLOAD_SAMPLING[name])
                seconds, tokens = run_request(engine, prompt, params)
                tpot.setdefault((name, spec), []).append(seconds)
                if outputs.setdefault(name, tokens) != tokens:
                    raise SystemExit(f"{name}: speculation={spec} changed the output")
                if spec:
                    accept[name][0] += stats.num_drafted - before[0]
                    accept[name][1] += stats.num_accepted - before[1]
    rows = []
    for name in prompts:
        off, on = tpot[(name, False)], tpot[(name, True)]
        drafted, accepted = accept[name]
        rows.append({"workload": name, "tpot_off_ms": [1e3 * t for t in off],
                     "tpot_on_ms": [1e3 * t for t in on],
                     "p50_off_ms": 1e3 * statistics.median(off),
                     "p50_on_ms": 1e3 * statistics.median(on),
                     "ratio_on_off": statistics.median(on) / statistics.median(off),
                     "drafted": drafted, "accepted": accepted,
                     "acceptance": accepted / drafted if drafted else 0.0})
    print(f"{'workload':8} {'TPOT off p50 (min-max) ms':>27} {'TPOT on p50 (min-max) ms':>26} "
          f"{'on/off':>7} {'accepted':>9}")
    for r in rows:
        off, on = r["tpot_off_ms"], r["tpot_on_ms"]
        print(f"{r['workload']:8} {r['p50_off_ms']:9.2f} ({min(off):6.2f}-{max(off):6.2f}) "
              f"{r['p50_on_ms']:12.2f} ({min(on):6.2f}-{max(on):6.2f}) "
              f"{r['ratio_on_off']:7.2f} {r['acceptance']:8.0%}")
    config = dict(vars(args))
    repo = Path(__file__).resolve().parent.parent
    out = Path(args.out).resolve()
    # Recorded relative to the repository: no tracked file points outside it.
    config["out"] = str(out.relative_to(repo)) if out.is_relative_to(repo) else out.name
    result = {"config": config, "quantization": engine.quantization,
              "load_avg": os.getloadavg(), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}; load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
