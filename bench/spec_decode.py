"""Speculative decoding (n-gram and suffix drafts): time per output token with and without.

One NORMAL engine per proposer in this process (`--speculative ngram`, `--speculative suffix`,
the same loaded weights; the servers' default mode otherwise); the baseline is the first
engine with the request field `speculative=False`, so all run on the same process, weights and
threads. Each repeat runs every (workload, method) pair once, in turn (interleaved), one
request at a time (c1):
  copy    greedy; the prompt is a passage followed by its first sentences again: the model
          goes on copying it (the output mostly repeats the prompt)
  loop    greedy, ignore_eos; a short open prompt this 135M model answers in a loop (it
          repeats a sentence or a list)
  random  random token ids, sampled at temperature 1 with a seed, ignore_eos: nothing in the
          prompt to copy, and sampled text rarely repeats itself
Then the batch part (`--concurrency`, default 8): that many copy requests at once (each its own
passage rotation), output tokens per second of the whole batch, off / on with the cost model
that turns drafting off for a batch where it would not pay (speculation.py `StepCosts`) / on
with drafting forced every step (the cost model bypassed), interleaved over the repeats.
Every path must produce the same tokens (greedy; seeded sampling draws per output position):
the benchmark checks it on every run.
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


LOOP_PROMPT = "List the colours of the rainbow, one per line."


def workloads(tokenizer, vocab: int, prompt_len: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    return {"copy": tokenizer.encode(PASSAGE + PASSAGE[:200]),
            "loop": tokenizer.encode(LOOP_PROMPT),
            "random": rng.integers(100, vocab, prompt_len).tolist()}


def batch_prompts(tokenizer, num: int) -> list[list[int]]:
    """`num` copy prompts: the passage's sentences rotated, then its first ones again."""
    sentences = [x.strip() + "." for x in PASSAGE.split(". ") if x.strip()]
    out = []
    for i in range(num):
        text = " ".join(sentences[i % len(sentences):] + sentences[:i % len(sentences)])
        out.append(tokenizer.encode(text + " " + text[:200]))
    return out


WORKLOAD_SAMPLING = {"copy": {"temperature": 0.0}, "loop": {"temperature": 0.0},
                     "random": {"temperature": 1.0, "seed": 0}}


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


def run_batch(engine, prompts: list[list[int]], params) -> tuple[float, list[list[int]]]:
    """(output tokens per second, tokens per request) of `prompts` run together."""
    ids = [engine.add_request(None, prompt, params) for prompt in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    seconds = time.perf_counter() - start
    return sum(len(t) for t in tokens.values()) / seconds, [tokens[rid] for rid in ids]


def c1_part(args, engines, prompts, SamplingParams) -> list[dict]:
    """c1 TPOT per (workload, method), off on the first engine; outputs checked equal."""
    tpot: dict[tuple[str, str], list[float]] = {}
    accept = {(name, m): [0, 0, 0] for name in prompts for m in engines}
    outputs: dict[str, list[int]] = {}
    paths = [("off", next(iter(engines.values()))), *engines.items()]
    for name, prompt in prompts.items():  # warm-up: each path once
        for method, engine in paths:
            run_request(engine, prompt, SamplingParams(max_tokens=16, ignore_eos=True,
                                                       speculative=method != "off",
                                                       **WORKLOAD_SAMPLING[name]))
    for _ in range(args.repeats):
        for name, prompt in prompts.items():
            for method, engine in paths:
                stats = engine.speculator.stats
                before = (stats.num_drafted, stats.num_accepted, stats.num_skipped_batches)
                params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                        speculative=method != "off", **WORKLOAD_SAMPLING[name])
                seconds, tokens = run_request(engine, prompt, params)
                tpot.setdefault((name, method), []).append(seconds)
                if outputs.setdefault(name, tokens) != tokens:
                    raise SystemExit(f"{name}: speculation {method} changed the output")
                if method != "off":
                    accept[(name, method)][0] += stats.num_drafted - before[0]
                    accept[(name, method)][1] += stats.num_accepted - before[1]
                    accept[(name, method)][2] += stats.num_skipped_batches - before[2]
    rows = []
    for name in prompts:
        off = tpot[(name, "off")]
        for method in engines:
            on = tpot[(name, method)]
            drafted, accepted, skipped = accept[(name, method)]
            rows.append({"workload": name, "method": method,
                         "tpot_off_ms": [1e3 * t for t in off],
                         "tpot_on_ms": [1e3 * t for t in on],
                         "p50_off_ms": 1e3 * statistics.median(off),
                         "p50_on_ms": 1e3 * statistics.median(on),
                         "ratio_on_off": statistics.median(on) / statistics.median(off),
                         "drafted": drafted, "accepted": accepted,
                         "acceptance": accepted / drafted if drafted else 0.0,
                         "skipped_batches": skipped})
    print(f"{'workload':8} {'method':7} {'TPOT off p50 (min-max) ms':>27} "
          f"{'TPOT on p50 (min-max) ms':>26} {'on/off':>7} {'kept/drafted':>13} {'skipped':>8}")
    for r in rows:
        off, on = r["tpot_off_ms"], r["tpot_on_ms"]
        print(f"{r['workload']:8} {r['method']:7} {r['p50_off_ms']:9.2f} "
              f"({min(off):6.2f}-{max(off):6.2f}) {r['p50_on_ms']:12.2f} "
              f"({min(on):6.2f}-{max(on):6.2f}) {r['ratio_on_off']:7.2f} "
              f"{r['accepted']:6d}/{r['drafted']:<6d} {r['skipped_batches']:8d}")
    return rows


def batch_part(args, engine, prompts, SamplingParams) -> list[dict]:
    """c-N output tok/s: off / cost model / forced drafting, interleaved; outputs equal."""
    from baton.engine.speculation import StepCosts

    class Forced(StepCosts):
        def plan(self, num_rows: int, chances) -> list[int]:
            return [len(row) for row in chances]

    model, forced = engine.speculator.costs, Forced()
    rate: dict[str, list[float]] = {}
    skipped: dict[str, int] = {"off": 0, "cost model": 0, "forced": 0}
    want = None
    for repeat in range(args.repeats + 1):  # the first round warms up
        for mode in ("off", "cost model", "forced"):
            engine.speculator.costs = forced if mode == "forced" else model
            before = engine.speculator.stats.num_skipped_batches
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                    speculative=mode != "off")
            tok_s, tokens = run_batch(engine, prompts, params)
            if (want := want or tokens) != tokens:
                raise SystemExit(f"batch: {mode} changed the output")
            if repeat:
                rate.setdefault(mode, []).append(tok_s)
                skipped[mode] += engine.speculator.stats.num_skipped_batches - before
    engine.speculator.costs = model
    rows = [{"mode": mode, "tok_s": rate[mode], "p50_tok_s": statistics.median(rate[mode]),
             "vs_off": statistics.median(rate[mode]) / statistics.median(rate["off"]),
             "skipped_batches": skipped[mode]} for mode in rate]
    print(f"\nc{len(prompts)} copy, {engine.speculator.method}: output tok/s")
    print(f"{'mode':11} {'p50 (min-max)':>22} {'vs off':>7} {'batches not drafted':>20}")
    for r in rows:
        print(f"{r['mode']:11} {r['p50_tok_s']:8.1f} ({min(r['tok_s']):6.1f}-"
              f"{max(r['tok_s']):6.1f}) {r['vs_off']:7.2f} {r['skipped_batches']:20d}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=128, help="random workload's prompt")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--methods", default="ngram,suffix", help="proposers, comma-separated")
    ap.add_argument("--concurrency", type=int, default=8, help="the batch part; 0 = skip it")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per engine")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "spec_decode.json"))
    args = ap.parse_args()

    import torch

    from baton.engine import EngineConfig, LLMEngine
    from baton.model import load_model
    from baton.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_model(quantization=args.quantization, device="cpu")
    engines = {method: LLMEngine(EngineConfig(
        quantization=args.quantization, num_threads=args.threads, speculative=method,
        num_blocks=args.num_blocks, num_speculative_tokens=args.num_speculative_tokens),
        loaded=loaded) for method in args.methods.split(",")}
    first = next(iter(engines.values()))
    load_start = os.getloadavg()
    prompts = workloads(loaded.tokenizer, first.model_config.vocab_size, args.prompt_len)
    rows = c1_part(args, engines, prompts, SamplingParams)
    batch = (batch_part(args, engines[list(engines)[-1]],
                        batch_prompts(loaded.tokenizer, args.concurrency), SamplingParams)
             if args.concurrency else [])
    config = dict(vars(args))
    repo = Path(__file__).resolve().parent.parent
    out = Path(args.out).resolve()
    # Recorded relative to the repository: no tracked file points outside it.
    config["out"] = str(out.relative_to(repo)) if out.is_relative_to(repo) else out.name
    result = {"config": config, "quantization": first.quantization,
              "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "rows": rows,
              "batch": batch}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}; load average at the start {load_start[0]:.2f}, "
          f"at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
