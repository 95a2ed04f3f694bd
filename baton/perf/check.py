"""A profile against a real engine's steps on a workload: where its fit holds and where not.

`baton profile` fits its costs on a grid of lone prompts and uniform decode batches; a workload's
steps are other shapes (several prompts in one step, chunks of a long prompt behind a long
context, decode batches of mixed contexts whose rows join and leave). `check_steps` runs the
workload's prompts, all queued at once, through one real engine built as `baton profile` builds
it (the loaded model, one torch thread, the load cache), records every step's shape, the
forward's time inside the runner's `execute` and the whole `LLMEngine.step()` around it, and
predicts each step with the profile (`Profile.step_ms`). The steps are grouped by kind:

    prefill x1        a prompt step of one sequence (what the grid measured)
    prefill xN        a prompt step of several sequences
    decode +new bB    a decode step that holds a sequence's first decode row (batch bucket B)
    decode bB         the other decode steps

and each group reports its steps, measured and predicted milliseconds (summed) and the mean
relative error of a step. In-process, as the profile was measured: what it shows is the fit's,
not the service's (the router, the client, the other engine sharing the cores).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from baton.perf.profile import Profile
from baton.perf.timing import TimedRunner

BATCH_BUCKETS = (1, 4, 8, 16, 32, 64)  # decode groups: batch <= each bound


@dataclass
class StepRecord:
    prompt_run: bool
    num_seqs: int
    num_tokens: int  # tokens computed (sum q)
    num_context: int  # sum k
    num_new_rows: int  # decode: rows whose sequence had no decode row in an earlier step
    num_sampled: int
    forward_ms: float  # measured inside the runner's execute
    step_ms: float  # measured around LLMEngine.step()
    predicted_ms: float  # the profile's whole step
    seqlens_q: list[int]  # per sequence: tokens computed, and context after the step
    seqlens_k: list[int]

    @property
    def group(self) -> str:
        if self.prompt_run:
            return "prefill x1" if self.num_seqs == 1 else "prefill xN"
        bucket = next((b for b in BATCH_BUCKETS if self.num_seqs <= b), BATCH_BUCKETS[-1])
        return f"decode {'+new ' if self.num_new_rows else ''}b<={bucket}"


def check_steps(profile: Profile, prompts: Sequence[tuple[str, int]], *, num_threads: int = 1,
                num_blocks: int = 0, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                model: str | None = None, quantization: str = "auto", runner=None) -> dict:
    """`prompts`: (text, max_tokens) each, queued at once and run to the end (greedy,
    ignore_eos). `runner`: another runner than the loaded model's (a test's mock). Returns
    {"steps": [...], "groups": {group: {...}}, "total": {...}}."""
    from baton.engine import EngineConfig, LLMEngine
    from baton.load_cache import default_cache_dir
    from baton.sampling.params import SamplingParams

    engine = LLMEngine(EngineConfig(
        model=model, quantization=quantization, num_threads=num_threads,
        decode_threads=num_threads, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        load_cache_dir=None if runner is not None else default_cache_dir()), runner=runner)
    rec = TimedRunner(engine.runner)
    for text, max_tokens in prompts:
        engine.add_request(None, text, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                      ignore_eos=True))
    steps: list[StepRecord] = []
    decoded: set[int] = set()
    while engine.has_unfinished():
        rec.calls.clear()
        t0 = time.perf_counter()
        engine.step()
        step_ms = (time.perf_counter() - t0) * 1e3
        if len(rec.calls) != 1:
            continue  # an empty step (nothing ran)
        prompt_run, q, k, ids, num_sampled, ms = rec.calls[0]  # an ExecuteCall
        new = 0 if prompt_run else sum(int(i) not in decoded for i in ids)
        if not prompt_run:
            decoded.update(int(i) for i in ids)
        steps.append(StepRecord(prompt_run, len(q), int(q.sum()), int(k.sum()), new,
                                num_sampled, ms, step_ms,
                                profile.step_ms(prompt_run, q, k, num_sampled),
                                q.tolist(), k.tolist()))
    return {"steps": [{**vars(s), "group": s.group} for s in steps],
            "groups": summarize_steps(steps), "total": _group(steps)}


def summarize_steps(steps: Sequence[StepRecord]) -> dict[str, dict]:
    groups: dict[str, list[StepRecord]] = {}
    for s in steps:
        groups.setdefault(s.group, []).append(s)
    return {name: _group(g) for name, g in sorted(groups.items())}


def _group(steps: Sequence[StepRecord]) -> dict:
    measured = np.array([s.step_ms for s in steps])
    predicted = np.array([s.predicted_ms for s in steps])
    rel = (predicted - measured) / np.maximum(measured, 1e-9)
    return {"num_steps": len(steps), "measured_ms": float(measured.sum()),
            "predicted_ms": float(predicted.sum()),
            "mean_seqs": float(np.mean([s.num_seqs for s in steps])) if steps else 0.0,
            "mean_tokens": float(np.mean([s.num_tokens for s in steps])) if steps else 0.0,
            "mean_rel_err": float(rel.mean()) if steps else 0.0,
            "mean_abs_rel_err": float(np.abs(rel).mean()) if steps else 0.0}


def format_groups(result: dict) -> str:
    lines = [f"{'group':<16} {'steps':>5} {'seqs':>5} {'tokens':>7} {'measured ms':>12} "
             f"{'predicted':>10} {'sum err':>8} {'step err':>9}"]
    for name, g in [*result["groups"].items(), ("all", result["total"])]:
        err = (g["predicted_ms"] - g["measured_ms"]) / g["measured_ms"] if g["measured_ms"] \
            else 0.0
        lines.append(f"{name:<16} {g['num_steps']:>5} {g['mean_seqs']:>5.1f} "
                     f"{g['mean_tokens']:>7.0f} {g['measured_ms']:>12.0f} "
                     f"{g['predicted_ms']:>10.0f} {100 * err:>+7.0f}% "
                     f"{100 * g['mean_rel_err']:>+8.0f}%")
    return "\n".join(lines)
