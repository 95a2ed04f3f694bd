"""What a two-beat pipeline could hide: the share of a decode step spent outside the forward.

The two-beat pipeline (issue 28 item 3; docs/scheduler.md S3, "In-flight steps") would build step
N+1 (schedule with -1 placeholders, prepare its inputs) while step N's forward runs, and book
step N while N+1 runs. It can hide at most the engine's work outside the model's forward: the
scheduler's schedule and process_outputs, the runner's input tensors and sampling, the
engine's booking and outputs. This measures that work, per decode step, at c1 and cN (one
NORMAL engine in this process, the default quantization, greedy, ignore_eos, no
speculation): the step's wall time (`LLMEngine.step`), the forward's (`ModelRunner.forward`,
the model and its backend), the sampler's, and the rest. Each repeat runs c1 then cN
(interleaved); the table gives medians over every decode step of the repeats.

    python bench/decode_overlap.py --repeats 3

Writes bench/results/decode_overlap.json. State the machine's load (`uptime`) with any figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def timed(obj, name: str, sink: list[float]) -> None:
    """Wrap `obj.name` so each call's wall time is appended to `sink`."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            sink.append(time.perf_counter() - start)

    setattr(obj, name, wrapper)


def run(engine, prompts, params, clocks: dict[str, list[float]]) -> list[dict[str, float]]:
    """Per decode step: step / forward / sampler seconds (prompt steps left out)."""
    for prompt in prompts:
        engine.add_request(None, prompt, params)
    steps = []
    while engine.has_unfinished():
        for sink in clocks.values():
            sink.clear()
        decode_before = engine.num_decode_steps
        start = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        if engine.num_decode_steps > decode_before:
            steps.append({"step": seconds, "forward": sum(clocks["forward"]),
                          "sampler": sum(clocks["sampler"])})
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                         "decode_overlap.json"))
    args = ap.parse_args()

    import numpy as np
    import torch

    from baton.engine import EngineConfig, LLMEngine
    from baton.model import load_model
    from baton.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_model(quantization=args.quantization, device="cpu")
    engine = LLMEngine(EngineConfig(quantization=args.quantization, num_threads=args.threads,
                                    num_blocks=1024), loaded=loaded)
    clocks: dict[str, list[float]] = {"forward": [], "sampler": []}
    timed(engine.runner, "forward", clocks["forward"])
    timed(engine.runner, "sampler", clocks["sampler"])
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    prompts = [rng.integers(100, vocab, args.prompt_len).tolist()
               for _ in range(args.concurrency)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    load_start = os.getloadavg()
    run(engine, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), clocks)  # warm-up
    per: dict[int, list[dict[str, float]]] = {1: [], args.concurrency: []}
    for _ in range(args.repeats):
        for num in per:
            per[num].extend(run(engine, prompts[:num], params, clocks))
    rows = []
    for num, steps in per.items():
        med = {key: 1e3 * statistics.median(s[key] for s in steps)
               for key in ("step", "forward", "sampler")}
        rest = [1e3 * (s["step"] - s["forward"] - s["sampler"]) for s in steps]
        outside = [1e3 * (s["step"] - s["forward"]) for s in steps]
        rows.append({"concurrency": num, "num_steps": len(steps), "step_ms": med["step"],
                     "forward_ms": med["forward"], "sampler_ms": med["sampler"],
                     "rest_ms": statistics.median(rest),
                     "outside_forward_ms": statistics.median(outside),
                     "outside_share": statistics.median(outside) / med["step"]})
    print(f"{'conc':>4} {'steps':>6} {'step ms':>8} {'forward':>8} {'sampler':>8} {'rest':>7} "
          f"{'outside fwd':>12}")
    for r in rows:
        print(f"{r['concurrency']:4d} {r['num_steps']:6d} {r['step_ms']:8.2f} "
              f"{r['forward_ms']:8.2f} {r['sampler_ms']:8.2f} {r['rest_ms']:7.2f} "
              f"{r['outside_forward_ms']:8.2f} ({r['outside_share']:.0%})")
    config = dict(vars(args))
    repo = Path(__file__).resolve().parent.parent
    out = Path(args.out).resolve()
    config["out"] = str(out.relative_to(repo)) if out.is_relative_to(repo) else out.name
    result = {"config": config, "quantization": engine.quantization,
              "load_avg_start": load_start, "load_avg_end": os.getloadavg(), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}; load average at the start {load_start[0]:.2f}, "
          f"at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
