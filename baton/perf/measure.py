"""`baton profile`: measure this machine's engine on a grid and fit the profile (docs/profile.md).

The real engine runs real steps (the model loaded through the real loader, one torch thread by
default so another process keeps the other core). Each step's forward is timed inside the
runner's `execute` and the whole `LLMEngine.step()` around it; the difference is the engine's
own work (`sampling.step_ms`, `sampling.row_ms`). Grammar: decode batches whose every row
follows a JSON schema (`STRUCTURED_SCHEMA`), each after a plain batch of the same shape; what a
grammar step takes beyond the plain one, per row, is `sampling.grammar_row_ms` (the mask built
in the engine core and applied in the sampler). Prefill: a prompt of `tokens` new tokens
behind `cached` tokens already in the prefix cache (put there by an earlier request), and steps
of several uncached prompts at once (`prefill_batches`), in `Grid.repeats` passes: the first
before the decode grid, the others after `admit`, and how far the last pass's steps moved from
the first's is kept (`machine.prefill_passes`). Decode: `batch` requests of `context`
tokens each (each row its own context, prefilled alone first), several decode steps; the one-row
points in `Grid.one_row_rounds` rounds (first, with the grid, last), the host's noisiest step
taken at several moments and the median round's fitted. Every point's shape and time is kept
in the file (`machine.grid`). KV transfer: a copy of `n` scattered blocks between two pools in
this process (NIXL between processes is not measured here yet; the profile's
`machine.transfer_method` says so). Last (after the contention phase), what a decode row new to
an engine costs in its first step (`admit`: a completion engine's pulled request, its row
gathered from the pool), on a completion-mode engine of the same weights; then the last round
of one-row decode points, and the fits.
"""

from __future__ import annotations

import logging
import platform
import sys
import time
from dataclasses import dataclass, replace

import numpy as np

from baton.perf.contention import ContentionGrid, measure_contention, num_turns
from baton.perf.profile import (
    ADMIT_FEATURES,
    PREPARE_FEATURES,
    LinearCost,
    ModelInfo,
    Profile,
    fit_grid,
    fit_linear,
)
from baton.perf.timing import TimedRunner, decode_steps, random_prompt

logger = logging.getLogger(__name__)


@dataclass
class Grid:
    prefill_tokens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024)
    prefill_cached: tuple[int, ...] = (0, 512, 1536)
    decode_batch: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_context: tuple[int, ...] = (64, 512, 1536, 3072)
    # A decode point's rows each have their own context (a workload's rows share none), each
    # prefilled alone first: points whose rows hold more context than this in all are left
    # out (their prefill would take minutes); the fit's context term extends to them.
    decode_max_tokens: int = 8192
    decode_steps: int = 4  # decode steps timed per point (after one untimed)
    # Rounds of the one-row decode points (batch 1), spread over the measurement: with the
    # decode grid, first of all (a second round) and last (a third and more). A step of one
    # row reads every weight for one token and moves with the host more than any other
    # (x1.15-1.23 between probes minutes apart, bench/sim_validate.py runs 12-17); measured
    # once, a profile could catch it 20% slow for the hour after (run 17). The fit takes the
    # median round's steps; `machine.one_row_rounds` keeps every round's mean.
    one_row_rounds: int = 3
    transfer_blocks: tuple[int, ...] = (1, 4, 16, 64, 128)
    # Passes of the prefill grid, minutes apart (both fitted), and repeats of each transfer
    # point (median kept).
    repeats: int = 2
    grammar_batch: tuple[int, ...] = (1, 4, 16)  # decode batches of grammar rows
    # Prompt steps of several uncached prompts, (prompts, tokens each): with the lone prompts
    # they tell what grows with the step's tokens (tokens_sq) from what grows with each
    # prompt's own length (self_kpairs), which lone prompts alone cannot (docs/profile.md).
    prefill_batches: tuple[tuple[int, int], ...] = ((4, 64), (16, 64), (8, 128), (4, 256))
    # Prompt lengths the router's prepare (the prompt tokenized) is timed at.
    prepare_tokens: tuple[int, ...] = (32, 128, 512, 1024, 2048, 4096, 8192)
    # Contexts (tokens) of the requests whose first decode step on a completion-mode core is
    # timed against their later ones (`admit`), each `admit_repeats` times.
    admit_context: tuple[int, ...] = (64, 256, 1024)
    admit_repeats: int = 3

    def __post_init__(self) -> None:
        if self.one_row_rounds < 1:
            raise ValueError(f"one_row_rounds must be >= 1, got {self.one_row_rounds}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")


QUICK = Grid(prefill_tokens=(16, 128, 512), prefill_cached=(0, 512),
             decode_batch=(1, 4, 16, 32), decode_context=(64, 512), decode_steps=3,
             transfer_blocks=(1, 16, 64), repeats=1, grammar_batch=(1, 8),
             prefill_batches=((4, 64), (4, 256)), prepare_tokens=(32, 512, 2048, 8192),
             admit_context=(64, 512), admit_repeats=2, one_row_rounds=1)



class _Bar:
    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def step(self, what: str) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // self.total
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                         f"{what:<40}")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def measure(model: str | None = None, quantization: str = "auto", num_threads: int = 1,
            grid: Grid | None = None, load_cache_dir: str | None = None,
            contention: ContentionGrid | None = None) -> Profile:
    """`load_cache_dir`: the engines' load cache (None: the one `baton engine` uses).
    `contention`: last, how a second engine of the model on this host slows this one's steps
    (baton/perf/contention.py); None: not measured (the profile has no `contention`)."""
    from baton.engine import EngineConfig, LLMEngine
    from baton.load_cache import default_cache_dir
    from baton.sampling.params import SamplingParams

    grid = grid or Grid()
    t0 = time.perf_counter()
    # Through the load cache, as `baton engine` loads (engine_start_s is what an engine of
    # `baton up` takes, not a cold read of the model file).
    engine = LLMEngine(EngineConfig(model=model, quantization=quantization,
                                    num_threads=num_threads, decode_threads=num_threads,
                                    load_cache_dir=load_cache_dir or default_cache_dir()))
    start_s = time.perf_counter() - t0
    timed = TimedRunner(engine.runner)
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    decode_points = [(b, c) for b in grid.decode_batch for c in grid.decode_context
                     if b * c <= grid.decode_max_tokens]
    one_row = [(b, c) for b, c in decode_points if b == 1]
    extra_rounds = max(0, grid.one_row_rounds - 1)
    bar = _Bar(len(grid.prefill_tokens) * len(grid.prefill_cached) * grid.repeats
               + len(grid.prefill_batches) * grid.repeats
               + len(decode_points) + extra_rounds * len(one_row) + len(grid.transfer_blocks)
               + len(grid.grammar_batch) + len(grid.prepare_tokens)
               + (num_turns(contention) if contention else 0) + len(grid.admit_context))
    rows: list[tuple[int, float, float]] = []  # (sampled rows, forward ms, step ms)
    # The raw points (shape and forward ms) the fits are made on (`fit_grid`), kept in the
    # file so another fit can be tried without measuring again (`machine.grid`,
    # docs/profile.md; `baton profile --refit`).
    raw: dict[str, list] = {"prefill": [], "decode": []}
    greedy1 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prefill(prompts: list[list[int]], what: str) -> None:
        """One generate of `prompts` (max_tokens 1): its prompt steps are grid points."""
        timed.calls.clear()
        ts = time.perf_counter()
        engine.generate(prompts, greedy1)
        step_ms = (time.perf_counter() - ts) * 1e3
        for call in timed.calls:
            if call.prompt_run:
                q, k = call.seqlens_q, call.seqlens_k
                raw["prefill"].append([q.tolist(), k.tolist(), round(call.forward_ms, 3)])
        if len(timed.calls) == 1:
            rows.append((timed.calls[0].num_sampled, timed.calls[0].forward_ms, step_ms))
        bar.step(what)

    # The one-row points' rounds (`Grid.one_row_rounds`): each round's steps per context; the
    # fit takes the round of the median mean (of two, the faster), so one round the host
    # disturbed (run 18's profile: 8.9-11.4 ms a step at 64 tokens in one, 6.4-7.1 in the
    # other two) moves nothing.
    one_row_steps: dict[int, list[list]] = {}

    def decode(batch: int, context: int, what: str) -> None:
        """Decode steps of `batch` rows of `context` tokens each: grid points (a one-row
        point's into its rounds)."""
        params = SamplingParams(max_tokens=grid.decode_steps + 2, temperature=0.0,
                                ignore_eos=True)
        # Each row its own context, as a workload's rows (until 6 December 2026 the rows shared
        # one prefix, which reads the same blocks for every row: decode steps of 8-16 separate
        # rows ran 9-34% over that fit). The rows are prefilled first (one token each), then
        # queued again: a prefix-cache hit for all but the last block, so one prompt step
        # holds the whole batch's tails and the decode steps hold the whole batch (queued
        # uncached, the rows spread over several prompt steps and the first finished before
        # the last began).
        prompts = [random_prompt(rng, context, vocab) for _ in range(batch)]
        engine.generate(prompts, greedy1)
        for prompt in prompts:
            engine.add_request(None, prompt, params)
        points = []
        for k, n, ms, step_ms in decode_steps(engine, timed, batch):
            points.append([k.tolist(), round(ms, 3)])
            rows.append((n, ms, step_ms))
        if batch == 1:
            one_row_steps.setdefault(context, []).append(points)
        else:
            raw["decode"].extend(points)
        bar.step(what)

    def one_row_round(when: str) -> None:
        for batch, context in one_row:
            decode(batch, context, f"decode 1 x {context} ({when})")

    # The prefill grid's repeats are passes minutes apart (`Grid.repeats`): the first before
    # the decode grid, the others after `admit`. Back to back, a slow minute (run 19's
    # profile: the fit's constant 98 ms against 58 in the profile before) fell on every
    # repeat of the same points and bent the fit's shape; apart, each point is seen at two
    # moments, and the passes' ratio tells how far the host moved (`machine.prefill_passes`).
    passes: list[list[float]] = []

    def prefill_pass(r: int) -> None:
        first = len(raw["prefill"])
        when = f" (pass {r + 1})" if grid.repeats > 1 else ""
        for tokens in grid.prefill_tokens:
            for cached in grid.prefill_cached:
                prefix = random_prompt(rng, cached, vocab)
                if cached:
                    engine.generate([prefix], greedy1)
                prefill([prefix + random_prompt(rng, tokens, vocab)],
                        f"prefill {tokens} behind {cached}{when}")
        for num_prompts, tokens in grid.prefill_batches:
            prefill([random_prompt(rng, tokens, vocab) for _ in range(num_prompts)],
                    f"prefill {num_prompts} x {tokens}{when}")
        passes.append([ms for _q, _k, ms in raw["prefill"][first:]])

    if extra_rounds:
        one_row_round("first round")
    prefill_pass(0)
    for batch, context in decode_points:
        decode(batch, context, f"decode batch {batch} x {context}")
    grammar_ms = _grammar_row_ms(engine, timed, grid, rng, vocab, bar)
    latency_ms, bytes_per_ms, method = _transfer(engine, grid, bar)
    prepare = prepare_cost(engine.tokenizer, grid, rng, bar)
    x = np.array([(1.0, n) for n, _, _ in rows])
    y = np.array([s - f for _, f, s in rows])
    step_ms, row_ms = np.maximum(np.linalg.lstsq(x, y, rcond=None)[0], 0.0)
    spec = engine.kv_spec
    m = ModelInfo(name=engine.model_path.rstrip("/").rsplit("/", 1)[-1],
                  fingerprint=engine.model_fingerprint, quantization=engine.quantization,
                  dtype=str(spec.dtype).removeprefix("torch."), block_size=spec.block_size,
                  num_blocks=engine.num_total_blocks(),
                  kv_bytes_per_block=int(engine.kv_cache[0].numel()
                                         * engine.kv_cache.element_size()),
                  vocab_size=vocab, max_position=engine.model_config.max_position)
    found, machine = None, {}
    if contention is not None:
        found, machine["contention"] = measure_contention(
            engine, timed, model, quantization, num_threads, load_cache_dir, contention,
            bar.step)
    admit, machine["admit"] = _admit_cost(engine, grid, rng, vocab, bar)
    for r in range(1, grid.repeats):
        prefill_pass(r)
    machine["prefill_passes"] = pass_summary(passes)
    for _ in range(extra_rounds - 1):
        one_row_round("last round")
    machine["one_row_rounds"] = {}
    for context, rounds in one_row_steps.items():
        rounds = [r for r in rounds if r]  # (a grid of too few decode steps times none)
        if rounds:
            means = [float(np.mean([ms for _, ms in r])) for r in rounds]
            median = sorted(range(len(rounds)), key=means.__getitem__)[(len(rounds) - 1) // 2]
            raw["decode"].extend(rounds[median])
            machine["one_row_rounds"][str(context)] = [round(m, 3) for m in means]
    prefill_cost, decode_cost = fit_grid(raw)
    return Profile(
        model=m, prefill=prefill_cost, decode=decode_cost, sample_row_ms=float(row_ms),
        step_overhead_ms=float(step_ms),
        grammar_row_ms=grammar_ms, transfer_latency_ms=latency_ms,
        transfer_bytes_per_ms=bytes_per_ms, engine_start_s=start_s, prepare=prepare,
        contention=found, admit=admit,
        machine={"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                 "threads": num_threads, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                 "transfer_method": method, "grid": raw, **machine})


def pass_summary(passes: list[list[float]]) -> dict:
    """The prefill grid's passes (each its steps' forward ms, in the same order): each pass's
    total and `drift`, the median over the steps of the last pass's time over the first's (1:
    the host kept its speed; one pass: 1)."""
    ratios = [b / a for a, b in zip(passes[0], passes[-1], strict=False) if a > 0]
    return {"total_ms": [round(sum(p), 1) for p in passes],
            "drift": round(float(np.median(ratios)), 4) if ratios else 1.0}


def _admit_cost(engine, grid: Grid, rng: np.random.Generator, vocab: int,
                bar: _Bar) -> tuple[LinearCost, dict]:
    """What a decode step costs more for a row new to its engine (`admit`): a completion
    engine's first step of a pulled request gathers the request's K/V of every layer from the
    pool into the CPU backend's dense decode rows (baton/model/backends/cpu_decode_rows.py), a
    cost that grows with its context, once; a normal engine's request comes out of its own
    prompt step with its row built. A completion-mode engine of the same weights with a pool
    and decode rows of its own (over `engine`'s runner, the decode rows the normal core left
    behind, under sequence ids the new core hands out again, made the gather an append of a
    stale row's tail: ~0 ms measured), each request added as prompted and
    committed without a pull (its K/V is not read for timing), stepped to its end: its first
    step's time less the median of its later ones (the last, which only drops it, left out),
    the median of `grid.admit_repeats` requests per context; then `const + tokens`, plain
    least squares with both coefficients >= 0 (`fit_linear`: the premium is a few ms against
    a noise of ~0.5, so a point can be ~0 or below)."""
    from baton.engine import LLMEngine
    from baton.protocol import COMPLETION
    from baton.sampling.params import SamplingParams

    # A block for every request's every token, none used twice: a pulled request's K/V is new
    # to the pool's memory (run again over the same blocks, a 1,024-token gather took a fifth
    # of its time: the pool warm in the CPU's caches).
    contexts = [max(1, min(c, engine.model_config.max_position - 16)) for c in grid.admit_context]
    bs = engine.config.block_size
    blocks = grid.admit_repeats * sum(-(-(n + 8) // bs) for n in contexts) + 2  # null included
    core = LLMEngine(replace(engine.config, engine_type=COMPLETION, num_blocks=blocks),
                     loaded=engine.runner.loaded)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    points = []
    for n in contexts:
        premia = []
        for r in range(grid.admit_repeats):
            rid = f"admit-{n}-{r}"
            core.add_prompted_request(rid, random_prompt(rng, n, vocab), [], params, 1, 0.0)
            core.commit_prompted(rid)
            times = []
            while core.has_unfinished():
                t0 = time.perf_counter()
                core.step()
                times.append((time.perf_counter() - t0) * 1e3)
            premia.append(times[0] - float(np.median(times[1:-1])))
        points.append((n, float(np.median(premia))))
        bar.step(f"a new decode row of {n} tokens")
    fit = fit_linear(ADMIT_FEATURES, [(1.0, float(n)) for n, _ in points],
                     [ms for _, ms in points], relative=False)
    return fit, {"first_step_extra_ms": [[n, round(ms, 3)] for n, ms in points]}


def prepare_cost(tokenizer, grid: Grid | None = None, rng: np.random.Generator | None = None,
                 bar: _Bar | None = None) -> LinearCost:
    """The router's prepare of a prompt (router/prepare.py: mostly its text tokenized, with the
    model's tokenizer), at each of the grid's lengths: the median of 5 encodes of the text of
    random tokens. The simulator delays each request by it before an engine sees it, in the
    router's order (simulator/fleet.py): a burst's long prompts reach the engines after its
    short ones, as live. Needs the tokenizer only (`baton profile --router-only`)."""
    grid = grid or Grid()
    rng = rng or np.random.default_rng(0)
    bar = bar or _Bar(len(grid.prepare_tokens))
    vocab = tokenizer.vocab_size
    rows, times = [], []
    for n in grid.prepare_tokens:
        text = tokenizer.decode(random_prompt(rng, n, vocab))
        num_tokens = len(tokenizer.encode(text))
        runs = []
        for _ in range(5):
            t = time.perf_counter()
            tokenizer.encode(text)
            runs.append((time.perf_counter() - t) * 1e3)
        rows.append((1.0, float(num_tokens)))
        times.append(float(np.median(runs)))
        bar.step(f"prepare {n} tokens")
    return fit_linear(PREPARE_FEATURES, rows, times)


def _grammar_row_ms(engine, timed: TimedRunner, grid: Grid, rng: np.random.Generator, vocab: int,
                    bar: _Bar) -> float:
    """Per grid batch b: b plain rows, then b rows that follow STRUCTURED_SCHEMA, of the same
    ~64-token prompts' shape, decoded back to back (so the machine's load falls on both alike);
    grammar_row_ms is the least-squares slope, through 0, of (grammar step - plain step, medians)
    against b, clipped at 0."""
    import llguidance

    from baton.sampling.params import SamplingParams
    from baton.workload.synthetic import STRUCTURED_SCHEMA

    grammar = llguidance.LLMatcher.grammar_from_json_schema(STRUCTURED_SCHEMA)
    # A grammar row costs ~1-3% of a step: medians of 16 steps or more each side.
    max_tokens = max(grid.decode_steps, 16) + 2
    plain = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                 grammar=grammar)
    sizes, extra = [], []
    for batch in grid.grammar_batch:
        medians = []
        for params in (plain, constrained):
            for _ in range(batch):
                engine.add_request(None, random_prompt(rng, 64, vocab), params)
            steps = [step_ms for _, n, _, step_ms in decode_steps(engine, timed, batch)
                     if n == batch]
            medians.append(float(np.median(steps)) if steps else None)
        if None not in medians:
            sizes.append(batch)
            extra.append(medians[1] - medians[0])
        bar.step(f"grammar batch {batch}")
    if not sizes:
        logger.warning("no grammar step was timed: sampling.grammar_row_ms is 0")
        return 0.0
    b, e = np.array(sizes, dtype=np.float64), np.array(extra)
    return max(0.0, float((b * e).sum() / (b * b).sum()))


def _transfer(engine, grid: Grid, bar: _Bar) -> tuple[float, float, str]:
    import torch

    pool = engine.kv_cache
    dst = torch.empty_like(pool[: max(grid.transfer_blocks) + 1])
    rng = np.random.default_rng(1)
    ns, ms = [], []
    for n in grid.transfer_blocks:
        times = []
        for _ in range(max(3, grid.repeats)):
            src_ids = torch.as_tensor(rng.choice(np.arange(1, pool.shape[0]), n, replace=False))
            t0 = time.perf_counter()
            dst[1:n + 1].copy_(pool.index_select(0, src_ids))
            times.append((time.perf_counter() - t0) * 1e3)
        ns.append(n)
        ms.append(float(np.median(times)))
        bar.step(f"transfer {n} blocks")
    bpb = pool[0].numel() * pool.element_size()
    slope, icpt = np.polyfit(np.asarray(ns, dtype=float) * bpb, ms, 1)
    return max(float(icpt), 0.0), 1.0 / max(float(slope), 1e-12), "in-process copy"
