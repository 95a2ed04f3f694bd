"""Sampler cost at batch 32 over SmolLM2's vocabulary (49152): milliseconds per call.

Run: .venv/bin/python bench/sampler_bench.py
Writes bench/results/sampler.json.

The baseline, measured in the same run, is the draw the sampler made before draws became a
function of (seed, sample_index, position): one `torch.multinomial` per seeded row with that
request's own generator, one batched multinomial for the unseeded rows. Each case runs ROUNDS
rounds of ITERS calls (cases in turn) and reports the lowest round median and the spread of
the round medians: on a shared machine a neighbour's burst inflates a round, never deflates it.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

from baton.model.sampler import Sampler, _uniforms
from baton.sampling.params import SamplingParams

RESULTS = Path(__file__).parent / "results" / "sampler.json"
BATCH, VOCAB, ROUNDS, ITERS = 32, 49152, 5, 10


def _old_draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """The previous sampler's last step, kept here only as the baseline."""
    out = torch.empty(len(generators), dtype=torch.long)
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        out[shared] = torch.multinomial(probs[shared], 1)[:, 0]
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
    return out


def _cases(logits: torch.Tensor) -> dict:
    sampler, outputs = Sampler(), [[5] * 40] * BATCH
    probs = (logits / 0.8).softmax(-1)
    cases = {}
    for label, seed in (("seeded", 7), ("unseeded", None)):
        params = [SamplingParams(temperature=0.8, seed=seed)] * BATCH
        gens = [torch.Generator().manual_seed(7) if seed is not None else None] * BATCH
        cases[f"{label}_sampler_call"] = lambda p=params: sampler(logits, p,
                                                                  output_token_ids=outputs)
        cases[f"{label}_baseline_multinomial_draw"] = lambda g=gens: _old_draw(probs, g)
        cases[f"{label}_new_draw"] = lambda p=params: sampler._sample_rows(
            logits, p, _uniforms(p, list(range(BATCH)), outputs, torch.device("cpu")))
    return cases


def main() -> None:
    torch.set_num_threads(2)
    logits = torch.randn(BATCH, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    cases = _cases(logits)
    medians: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, fn in cases.items():
            times = []
            for _ in range(ITERS):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            medians[name].append(1e3 * statistics.median(times))
    rows = {name: {"ms": min(m), "spread_ms": max(m) - min(m)} for name, m in medians.items()}
    for label in ("seeded", "unseeded"):
        rows[f"{label}_draw_ratio_new_vs_baseline"] = (
            rows[f"{label}_new_draw"]["ms"] / rows[f"{label}_baseline_multinomial_draw"]["ms"])
    print(f"{'case (batch 32, vocab 49152)':<40} {'ms':>9} {'spread':>9}")
    for name, row in rows.items():
        if isinstance(row, dict):
            print(f"{name:<40} {row['ms']:9.2f} {row['spread_ms']:9.2f}")
        else:
            print(f"{name:<40} {row:9.3f}x")
    RESULTS.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                   "torch_threads": 2, "cases": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
