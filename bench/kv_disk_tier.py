"""The local disk tier (README: KV tiers): returning turns of conversations whose working set is
~4x the KV pool, with the disk tier against recompute, in one run.

    .venv/bin/python bench/kv_disk_tier.py               # ~25 minutes on 2 busy cores
    .venv/bin/python bench/kv_disk_tier.py --quantization auto --prefix-tokens 300 \
        --num-blocks 32 --out bench/results/kv_disk_tier_int4.json

`--conversations` conversations take turns round-robin on two engines over the same loaded
weights and the same small pool (`--num-blocks`): one with `--kv-disk-dir` (a temp dir), one
without, turn by turn interleaved so that the machine's load falls on both alike. A turn is the
conversation so far (a held-out text window, then each earlier answer and user message) plus
a new user message; by the time a conversation returns, the others have pushed its blocks out
of the pool (the working set is printed against the pool), so the engine without a disk tier
recomputes it while the other loads it from disk. TTFT is timed in the engine (add_request to
the first token), greedy; the two engines' answers must be identical token for token.

Then the restart: the disk engine is closed (its pool's cached blocks go to disk too) and a new
engine over the same directory serves the next returning turn: its cached_tokens and TTFT.
Writes bench/results/kv_disk_tier.json and prints a table. Figures depend on the load: it is
recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "kv_disk_tier.json"


def source_windows(tokenizer, num: int, length: int, extra: int) -> list[list[int]]:
    """`num` windows of held-out prose (the Python reference manual), `length + extra` tokens
    each: the first `length` open a conversation, the rest are its user messages."""
    from pydoc_data.topics import topics

    ids = tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    step = (len(ids) - length - extra) // num
    return [ids[i * step:i * step + length + extra] for i in range(num)]


def timed_turn(engine, prompt: list[int], params) -> tuple[float, list[int], int]:
    """(TTFT seconds, the answer, cached prompt tokens) of one request run alone."""
    t0 = time.perf_counter()
    rid = engine.add_request(None, prompt, params)
    ttft, tokens, cached = None, [], 0
    while True:
        for out in engine.step():
            if out.request_id != rid:
                continue
            if out.new_token_ids and ttft is None:
                ttft, cached = time.perf_counter() - t0, out.num_cached_tokens or 0
            tokens.extend(out.new_token_ids)
            if out.finished:
                return ttft, tokens, cached


def p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3, help="turns per conversation")
    p.add_argument("--prefix-tokens", type=int, default=400, help="a conversation's opening")
    p.add_argument("--user-tokens", type=int, default=24, help="each later user message")
    p.add_argument("--answer-tokens", type=int, default=8)
    p.add_argument("--num-blocks", type=int, default=40, help="the pool (null block included)")
    p.add_argument("--quantization", default="none",
                   help="none: the exact mode, whose prefill costs in proportion to its tokens; "
                   "auto: the servers' int4, whose prompt steps carry a fixed cost")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    import torch

    from baton.engine import EngineConfig, LLMEngine
    from baton.model import load_model
    from baton.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_model(quantization=args.quantization, device="cpu")
    disk_dir = tempfile.mkdtemp(prefix="baton-kv-disk-bench-")

    def engine(disk: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(num_blocks=args.num_blocks, num_threads=args.threads,
                                      quantization=args.quantization,
                                      kv_disk_dir=disk_dir if disk else ""), loaded=loaded)

    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    extra = args.user_tokens * args.rounds
    sources = source_windows(loaded.tokenizer, args.conversations, args.prefix_tokens, extra)
    histories = [s[:args.prefix_tokens] for s in sources]
    engines = {"disk": engine(True), "recompute": engine(False)}
    turns = {mode: [] for mode in engines}
    load_before = os.getloadavg()
    mismatches = 0
    for r in range(args.rounds):
        for c, source in enumerate(sources):
            user = source[args.prefix_tokens + r * args.user_tokens:
                          args.prefix_tokens + (r + 1) * args.user_tokens]
            prompt = histories[c] + user
            answers = {}
            for mode, eng in engines.items():
                ttft, answers[mode], cached = timed_turn(eng, prompt, params)
                turns[mode].append({"round": r, "conversation": c, "prompt_tokens": len(prompt),
                                    "ttft_s": ttft, "cached_tokens": cached})
            mismatches += answers["disk"] != answers["recompute"]
            histories[c] = prompt + answers["recompute"]
        print(f"round {r}: load {os.getloadavg()[0]:.1f}", flush=True)
    bs = engines["disk"].config.block_size
    working_set = sum(-(-len(h) // bs) for h in histories)
    tiers = engines["disk"].tier_stats()
    engines["disk"].close()
    # Restart: a new engine over the same directory serves the next returning turn.
    restarted = engine(True)
    prompt = histories[0] + sources[0][-args.user_tokens:]
    ttft, answer, cached = timed_turn(restarted, prompt, params)
    cold_ttft, cold_answer, _ = timed_turn(engine(False), prompt, params)
    restart = {"ttft_s": ttft, "cached_tokens": cached, "recompute_ttft_s": cold_ttft,
               "prompt_tokens": len(prompt), "same_answer": answer == cold_answer,
               "files": restarted.disk.describe()}
    restarted.close()
    returning = {mode: [t["ttft_s"] for t in ts if t["round"] > 0] for mode, ts in turns.items()}
    summary = {mode: {"ttft_p50_s": p50(v), "ttft_min_s": min(v), "ttft_max_s": max(v),
                      "cached_tokens_p50": p50([t["cached_tokens"] for t in turns[mode]
                                                if t["round"] > 0])}
               for mode, v in returning.items()}
    ratio = summary["disk"]["ttft_p50_s"] / summary["recompute"]["ttft_p50_s"]
    result = {"args": vars(args) | {"out": os.path.relpath(args.out)},
              "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
              "pool_blocks": args.num_blocks - 1, "working_set_blocks": working_set,
              "working_set_over_pool": working_set / (args.num_blocks - 1),
              "returning_turns": summary, "ttft_ratio_disk_over_recompute": ratio,
              "answers_differing": mismatches, "restart": restart, "disk_tier": tiers,
              "turns": turns}
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"working set {working_set} blocks = {result['working_set_over_pool']:.1f}x the pool "
          f"({args.num_blocks - 1} blocks); load {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print("| returning turns | TTFT p50 ms [min-max] | cached tokens p50 |")
    print("|---|---|---:|")
    for mode, s in summary.items():
        print(f"| {mode} | {1e3 * s['ttft_p50_s']:.0f} [{1e3 * s['ttft_min_s']:.0f}-"
              f"{1e3 * s['ttft_max_s']:.0f}] | {s['cached_tokens_p50']:.0f} |")
    print(f"disk / recompute TTFT p50: {ratio:.2f}x; answers differing: {mismatches}")
    print(f"after a restart: cached_tokens {cached} of {len(prompt)}, TTFT {1e3 * ttft:.0f} ms "
          f"(recompute {1e3 * cold_ttft:.0f} ms), same answer: {restart['same_answer']}")


if __name__ == "__main__":
    main()
