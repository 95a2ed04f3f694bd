"""What a two-beat pipeline could hide: the share of a decode step spent outside the forward.

The two-beat pipeline (issue 28 item 3; docs/scheduler.md S3, "In-flight steps") would build step
N+1 (schedule with -1 placeholders, prepare its inputs) while step N's forward runs, and book
step N while N+1 runs. It can hide at most the engine's work outside the model's forward: the
scheduler's schedule and process_outputs, the runner's input tensors and sampling, the
engine's booking and outputs. This measures that work, per decode step, at c1 and cN (one
NORMAL engine in this process, the default quantization, greedy, ignore_eos, no
speculation): the step's wall time (`LLMEngine.step`), the model's (`ModelRunner.forward` less
its backend's `prepare`: what cannot overlap), the backend's input preparation, the sampler's,
and the rest (scheduler, booking, outputs); "hideable" = step - model, the pipeline's ceiling.
Each repeat runs c1 then cN (interleaved); the table gives medians over every decode step.

`--pipeline` measures the pipeline itself instead (`EngineConfig.async_scheduling`): two
engines over the same loaded weights, off and on, each repeat running c1 then cN on each in
turn (interleaved); per request TPOT = (last token's time - first's) / (tokens - 1), and
the batch's output tokens per second; the outputs must be equal (greedy), checked every run.

    python bench/decode_overlap.py --repeats 3
    python bench/decode_overlap.py --pipeline --repeats 5

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
                          "prepare": sum(clocks["prepare"]), "sampler": sum(clocks["sampler"])})
    return steps


def timed_batch(engine, prompts, params) -> tuple[list[float], float, list[list[int]]]:
    """(TPOT per request, output tok/s of the batch, tokens per request) of `prompts` at once."""
    ids = [engine.add_request(None, p, params) for p in prompts]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids:
                times[out.request_id].append(now)
                tokens[out.request_id].extend(out.new_token_ids)
    seconds = time.perf_counter() - start
    tpot = [(t[-1] - t[0]) / (len(tokens[rid]) - 1) for rid, t in times.items()]
    return tpot, sum(map(len, tokens.values())) / seconds, [tokens[rid] for rid in ids]


def pipeline_part(args, loaded, prompts, params) -> dict:
    """TPOT and tok/s with the two-beat pipeline off and on, c1 and cN, interleaved."""
    from baton.engine import EngineConfig, LLMEngine

    engines = {mode: LLMEngine(EngineConfig(quantization=args.quantization,
                                            num_threads=args.threads, num_blocks=1024,
                                            async_scheduling=mode == "on"), loaded=loaded)
               for mode in ("off", "on")}
    for engine in engines.values():  # warm-up
        timed_batch(engine, prompts[:1], params)
    tpot: dict[tuple[int, str], list[float]] = {}
    tok_s: dict[tuple[int, str], list[float]] = {}
    for rep in range(args.repeats):
        for num in (1, args.concurrency):
            want = None
            modes = ("off", "on") if rep % 2 == 0 else ("on", "off")
            for mode in modes:
                t, rate, tokens = timed_batch(engines[mode], prompts[:num], params)
                tpot.setdefault((num, mode), []).append(statistics.median(t))
                tok_s.setdefault((num, mode), []).append(rate)
                if want is not None and tokens != want:
                    raise SystemExit(f"c{num}: the pipeline changed the output")
                want = tokens
    rows = []
    for num in (1, args.concurrency):
        row = {"concurrency": num}
        for mode in ("off", "on"):
            ms = [1e3 * x for x in tpot[(num, mode)]]
            row[f"tpot_{mode}_ms"] = ms
            row[f"tok_s_{mode}"] = tok_s[(num, mode)]
        row["tpot_ratio_on_off"] = (statistics.median(row["tpot_on_ms"]) /
                                    statistics.median(row["tpot_off_ms"]))
        rows.append(row)
    print(f"{'conc':>4} {'TPOT off p50 (min-max) ms':>26} {'TPOT on p50 (min-max) ms':>26} "
          f"{'on/off':>7} {'tok/s off':>10} {'tok/s on':>9}")
    for r in rows:
        off, on = r["tpot_off_ms"], r["tpot_on_ms"]
        print(f"{r['concurrency']:4d} {statistics.median(off):9.2f} ({min(off):6.2f}-"
              f"{max(off):6.2f}) {statistics.median(on):12.2f} ({min(on):6.2f}-{max(on):6.2f}) "
              f"{r['tpot_ratio_on_off']:7.3f} {statistics.median(r['tok_s_off']):10.1f} "
              f"{statistics.median(r['tok_s_on']):9.1f}")
    steps = engines["on"].pipeline.num_two_beat_steps
    for engine in engines.values():
        engine.close()
    return {"rows": rows, "num_two_beat_steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pipeline", action="store_true",
                    help="measure the two-beat pipeline off and on (TPOT, tok/s)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    args.out = args.out or str(Path(__file__).parent / "results" / (
        "decode_overlap_pipeline.json" if args.pipeline else "decode_overlap.json"))

    import numpy as np
    import torch

    from baton.engine import EngineConfig, LLMEngine
    from baton.model import load_model
    from baton.sampling.params import SamplingParams

    torch.set_num_threads(args.threads)
    loaded = load_model(quantization=args.quantization, device="cpu")
    engine = LLMEngine(EngineConfig(quantization=args.quantization, num_threads=args.threads,
                                    num_blocks=1024), loaded=loaded)
    clocks: dict[str, list[float]] = {"forward": [], "prepare": [], "sampler": []}
    timed(engine.runner, "forward", clocks["forward"])
    timed(engine.runner.backend, "prepare", clocks["prepare"])
    timed(engine.runner, "sampler", clocks["sampler"])
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    prompts = [rng.integers(100, vocab, args.prompt_len).tolist()
               for _ in range(args.concurrency)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    load_start = os.getloadavg()
    if args.pipeline:
        result = {"config": {**vars(args), "out": Path(args.out).name},
                  "load_avg_start": load_start,
                  **pipeline_part(args, loaded, prompts, params),
                  "load_avg_end": os.getloadavg()}
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}; load average at the start {load_start[0]:.2f}, "
              f"at the end {os.getloadavg()[0]:.2f}")
        return
    run(engine, prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), clocks)  # warm-up
    per: dict[int, list[dict[str, float]]] = {1: [], args.concurrency: []}
    for _ in range(args.repeats):
        for num in per:
            per[num].extend(run(engine, prompts[:num], params, clocks))
    rows = []
    for num, steps in per.items():
        def med(fn, steps=steps) -> float:
            return 1e3 * statistics.median(fn(s) for s in steps)

        hideable = [s["step"] - s["forward"] + s["prepare"] for s in steps]
        rows.append({"concurrency": num, "num_steps": len(steps),
                     "step_ms": med(lambda s: s["step"]),
                     "model_ms": med(lambda s: s["forward"] - s["prepare"]),
                     "prepare_ms": med(lambda s: s["prepare"]),
                     "sampler_ms": med(lambda s: s["sampler"]),
                     "rest_ms": med(lambda s: s["step"] - s["forward"] - s["sampler"]),
                     "hideable_ms": 1e3 * statistics.median(hideable),
                     "hideable_share": statistics.median(
                         h / s["step"] for h, s in zip(hideable, steps, strict=True))})
    print(f"{'conc':>4} {'steps':>6} {'step ms':>8} {'model':>8} {'prepare':>8} {'sampler':>8} "
          f"{'rest':>7} {'hideable':>15}")
    for r in rows:
        print(f"{r['concurrency']:4d} {r['num_steps']:6d} {r['step_ms']:8.2f} "
              f"{r['model_ms']:8.2f} {r['prepare_ms']:8.2f} {r['sampler_ms']:8.2f} "
              f"{r['rest_ms']:7.2f} {r['hideable_ms']:8.2f} ({r['hideable_share']:.1%})")
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
