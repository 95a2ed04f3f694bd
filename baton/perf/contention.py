"""How two engines on one host slow each other's steps: `baton profile`'s last phase
(docs/profile.md, the profile's `contention`).

A second engine process (this module's `main`: the same model, quantization and threads as the
profile's engine) loads and waits; `measure_contention` then times the profile engine's own steps
of four shapes (a decode step of one row at 256 and at 1024 tokens of context, one of eight rows
at 128, a prompt step of 256 tokens) in turns: alone, beside the second engine prefilling
prompts back to back, alone, beside it decoding four rows, and so on, `ContentionGrid.rounds`
times, so that the host's drift (10-30% within the hour here) falls on both sides of each ratio.
Each factor is a shape's median step beside the other engine over its median alone, all rounds
together: `decode_beside_prefill` from the one-row shapes (their mean), the eight-row shape's
`batch_decode_beside_prefill`, `prefill_beside_decode` from the prompt step. Nothing is pinned:
the two processes share the host's cores as two engines of `baton up` do.

Measured between two bare engines, not through the router: on the 2-core AMD host of 7 December
2026 the live fleet's busy seconds (3-second phases through `baton up`) drifted 10-50% between
two phases a minute apart, more than the effect; per-step medians of interleaved turns hold to
a few percent. What the bare engines leave out (the router, the client, the KV pulls' copies and
checksums on the same cores) is not in the factors.

The second process reads one command a line on stdin (`prefill`, `decode`, `idle`; `quit` or
the end of input ends it, so it never outlives the profile) and answers each on stdout once it
has taken it up (`ok prefill`: its first prompt step starts now; `ok idle`: its last step has
ended and its requests are gone).
"""

from __future__ import annotations

import argparse
import logging
import queue
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from baton.perf.profile import Contention
from baton.perf.timing import TimedRunner, decode_steps, random_prompt

logger = logging.getLogger(__name__)

MODES = ("prefill", "decode", "idle")
START_TIMEOUT_S = 300.0  # the second engine's load (seconds here; a cold load cache takes more)
COMMAND_TIMEOUT_S = 60.0  # a mode taken up: at most one step of the mode before (~2 s here)
# The profile engine's shapes: (rows, context of each), or (0, tokens) for a prompt step.
SHAPES = {"one": (1, 256), "one_long": (1, 1024), "batch": (8, 128), "prefill": (0, 256)}


@dataclass
class ContentionGrid:
    rounds: int = 3  # turns of (alone, beside prefill, alone, beside decode)
    decode_steps: int = 16  # decode steps timed per shape and turn (after one untimed)
    prefill_repeats: int = 2  # prompt steps timed per turn
    load_rows: int = 4  # the second engine's decode load: rows of `load_context` tokens ...
    load_context: int = 128
    load_prompt_tokens: int = 512  # ... or its prompts, back to back


QUICK_CONTENTION = ContentionGrid(rounds=1, decode_steps=8, prefill_repeats=1)


# ---------------------------------------------------------------------------- the other engine
class _Load:
    """The second engine's work in the mode it was told: prompt steps back to back (each an
    uncached prompt, one token out), or decode steps of `load_rows` rows (each row a cached
    prompt decoding 64 tokens, topped up as they end)."""

    def __init__(self, engine, grid: ContentionGrid) -> None:
        from baton.sampling.params import SamplingParams

        self.engine, self.grid = engine, grid
        self.vocab = engine.model_config.vocab_size
        self.rng = np.random.default_rng(1)
        self.one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.many = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        # Within the model's positions (a test's tiny model has 256).
        room = engine.model_config.max_position - 72
        self.prompt_tokens = max(1, min(grid.load_prompt_tokens, room))
        self.rows = [random_prompt(self.rng, max(1, min(grid.load_context, room)), self.vocab)
                     for _ in range(grid.load_rows)]
        self.running: set[str] = set()
        self.cached = False

    def begin(self, mode: str) -> None:
        """Ready to run `mode` from its first step: the decode rows' prompts into the prefix
        cache (once), so that none of them is prefilled while the profile's engine times."""
        if mode == "decode" and not self.cached:
            self.engine.generate(self.rows, self.one)
            self.cached = True

    def step(self, mode: str) -> None:
        e = self.engine
        if mode == "prefill":
            e.generate([random_prompt(self.rng, self.prompt_tokens, self.vocab)], self.one)
            return
        self.running = {rid for rid in self.running if rid in e.requests}
        for i in range(self.grid.load_rows - len(self.running)):
            self.running.add(e.add_request(None, self.rows[i % len(self.rows)], self.many))
        e.step()

    def stop(self) -> None:
        """Its requests aborted and stepped out: nothing of it runs when idle."""
        for rid in self.running:
            self.engine.abort_request(rid)
        self.running.clear()
        while self.engine.has_unfinished():
            self.engine.step()


def serve(engine, grid: ContentionGrid, commands: queue.Queue, out=sys.stdout) -> None:
    """The second engine's loop: the current mode's steps, a command taken between steps."""
    load, mode = _Load(engine, grid), "idle"
    while True:
        try:
            cmd = commands.get(block=mode == "idle")
        except queue.Empty:
            cmd = None
        if cmd is not None:
            load.stop()
            if cmd not in MODES:  # "quit", or the end of input
                return
            load.begin(cmd)
            mode = cmd
            out.write(f"ok {mode}\n")
            out.flush()
        if mode != "idle":
            load.step(mode)


def main(argv: list[str] | None = None) -> int:
    from baton.engine import EngineConfig, LLMEngine
    from baton.load_cache import default_cache_dir

    p = argparse.ArgumentParser(prog="python -m baton.perf.contention",
                                description="the second engine of `baton profile`'s contention "
                                            "phase (commands on stdin)")
    p.add_argument("--model", default=None)
    p.add_argument("--quantization", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--load-cache-dir", default=None)
    args = p.parse_args(argv)
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization,
                                    num_threads=args.threads, decode_threads=args.threads,
                                    load_cache_dir=args.load_cache_dir or default_cache_dir()))
    commands: queue.Queue = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("quit")

    threading.Thread(target=read, name="commands", daemon=True).start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    serve(engine, ContentionGrid(), commands)  # the load's shapes: QUICK_CONTENTION's too
    engine.close()
    return 0


class _Other:
    """The second engine process, told what to run."""

    def __init__(self, model: str | None, quantization: str, num_threads: int,
                 load_cache_dir: str | None) -> None:
        cmd = [sys.executable, "-m", "baton.perf.contention", "--quantization", quantization,
               "--threads", str(num_threads)]
        cmd += ["--model", model] if model else []
        cmd += ["--load-cache-dir", load_cache_dir] if load_cache_dir else []
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        try:
            self._expect("ready", START_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    def run(self, mode: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(mode + "\n")
        self.proc.stdin.flush()
        self._expect(f"ok {mode}", COMMAND_TIMEOUT_S)

    def _expect(self, line: str, timeout_s: float) -> None:
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout_s)
        got = out.readline().strip() if ready else ""
        if got != line:
            raise RuntimeError(f"the contention phase's second engine said {got!r}, not "
                               f"{line!r}, within {timeout_s:.0f} s (exit code "
                               f"{self.proc.poll()})")

    def close(self) -> None:
        """End of input: it stops its work and exits; killed if it does not in time."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=COMMAND_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)


# ---------------------------------------------------------------------------- the profile side
def _timed(engine, timed: TimedRunner, grid: ContentionGrid, rows: dict[str, list[list[int]]],
           rng: np.random.Generator, vocab: int, times: dict[str, list[float]]) -> None:
    """One turn: each shape's steps on `engine` (its runner wrapped by `timed`) now, appended
    to `times` (ms). A decode shape's rows are cached prompts, so its decode steps hold all its
    rows, timed as `baton profile`'s grid times them (baton/perf/measure.py `decode_steps`,
    the first one left out). A prompt step: an uncached prompt, one token out."""
    from baton.sampling.params import SamplingParams

    for shape, prompts in rows.items():
        params = SamplingParams(max_tokens=grid.decode_steps + 3, temperature=0.0,
                                ignore_eos=True)
        for prompt in prompts:
            engine.add_request(None, prompt, params)
        steps = [step_ms for *_, step_ms in decode_steps(engine, timed, len(prompts))]
        if not steps:
            raise RuntimeError(f"the contention phase timed no decode step of {shape}")
        times[shape].extend(steps)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for _ in range(grid.prefill_repeats):
        t0 = time.perf_counter()
        engine.generate([random_prompt(rng, _fit(engine, grid, SHAPES["prefill"][1]), vocab)], one)
        times["prefill"].append((time.perf_counter() - t0) * 1e3)


def _fit(engine, grid: ContentionGrid, tokens: int) -> int:
    """A prompt's tokens within the model's positions, its decode steps after it (a test's
    tiny model has 256)."""
    return max(1, min(tokens, engine.model_config.max_position - grid.decode_steps - 8))


def measure_contention(engine, timed: TimedRunner, model: str | None, quantization: str,
                       num_threads: int, load_cache_dir: str | None,
                       grid: ContentionGrid | None = None, on_turn=None
                       ) -> tuple[Contention, dict]:
    """The profile engine's steps (its runner wrapped by `timed`) alone and beside a second
    engine of the same model (module docstring): the factors, and the medians they came from
    (`machine.contention`).
    `on_turn(what)` after each turn (the progress bar). Raises RuntimeError when the second
    engine does not start or answer."""
    grid = grid or ContentionGrid()
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(2)
    rows = {shape: [random_prompt(rng, _fit(engine, grid, context), vocab) for _ in range(n)]
            for shape, (n, context) in SHAPES.items() if n}
    from baton.sampling.params import SamplingParams

    engine.generate([p for prompts in rows.values() for p in prompts],  # cached, once
                    SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    conditions = ("alone", "beside_prefill", "beside_decode")
    times = {c: {shape: [] for shape in SHAPES} for c in conditions}
    other = _Other(model, quantization, num_threads, load_cache_dir)
    try:
        for _ in range(grid.rounds):
            for condition, mode in (("alone", "idle"), ("beside_prefill", "prefill"),
                                    ("alone", "idle"), ("beside_decode", "decode")):
                other.run(mode)
                _timed(engine, timed, grid, rows, rng, vocab, times[condition])
                if on_turn is not None:
                    on_turn(f"contention: {condition.replace('_', ' ')}")
    finally:
        other.close()
    medians = {c: {s: float(np.median(v)) for s, v in by_shape.items()}
               for c, by_shape in times.items()}

    def ratio(condition: str, shapes: tuple[str, ...]) -> float:
        # Under 1 is the host's noise, not a speed-up: read as no slowdown.
        return max(1.0, float(np.mean([medians[condition][s] / medians["alone"][s]
                                       for s in shapes])))

    found = Contention(decode_beside_prefill=ratio("beside_prefill", ("one", "one_long")),
                       batch_decode_beside_prefill=ratio("beside_prefill", ("batch",)),
                       prefill_beside_decode=ratio("beside_decode", ("prefill",)))
    return found, {"median_ms": {c: {s: round(v, 3) for s, v in m.items()}
                                 for c, m in medians.items()},
                   "shapes": {s: list(v) for s, v in SHAPES.items()},
                   "num_steps": sum(len(v) for by in times.values() for v in by.values())}


def num_turns(grid: ContentionGrid) -> int:
    return 4 * grid.rounds


if __name__ == "__main__":
    sys.exit(main())
