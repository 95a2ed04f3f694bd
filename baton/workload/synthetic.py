"""The synthetic workloads of `baton bench` and `baton sim`: seeded prompts of real words
(`fixed`, `uniform`, `mix`, `multi-turn`, `shared-prefix`) and Poisson arrivals."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from baton.workload.words import words

DATASETS = ("fixed", "uniform", "mix", "multi-turn", "shared-prefix")

# What a structured request asks for (OpenAI's response_format json_schema): a JSON object with
# a list of free strings, long enough to fill any max_tokens. `baton profile` times its grammar
# rows (`sampling.grammar_row_ms`), `baton bench` sends it, `baton sim` charges it.
STRUCTURED_SCHEMA = {"type": "object", "properties": {
    "items": {"type": "array", "items": {"type": "string"}}}, "required": ["items"]}


@dataclass
class WorkloadConfig:
    # fixed: every request input_len/output_len; uniform: lengths drawn from the ranges;
    # mix: chat traffic (short_* ranges) with a long_fraction of long prompts among it;
    # multi-turn: conversations of `turns` turns behind one shared system prompt of
    # system_prompt_len words, each turn's prompt the conversation so far plus a new user
    # message (short_* ranges), sent when the previous answer is complete;
    # shared-prefix: independent requests, each behind one of num_system_prompts system prompts.
    dataset: str = "mix"
    input_len: int = 64
    output_len: int = 96
    input_range: tuple[int, int] = (32, 256)
    output_range: tuple[int, int] = (32, 128)
    short_input_range: tuple[int, int] = (56, 72)  # "~64 tokens" chat prompts
    short_output_range: tuple[int, int] = (64, 128)
    long_fraction: float = 0.1
    long_input_range: tuple[int, int] = (1400, 1600)  # "~1500 tokens" documents
    long_output_range: tuple[int, int] = (16, 32)
    turns: int = 6  # multi-turn: turns per conversation (num_requests counts conversations)
    system_prompt_len: int = 512  # multi-turn, shared-prefix: words of each system prompt
    num_system_prompts: int = 4  # shared-prefix
    # Any dataset (a trace's too): the share of requests that ask for STRUCTURED_SCHEMA output.
    structured_fraction: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.turns < 1 or self.num_system_prompts < 1 or self.system_prompt_len < 0:
            raise ValueError(f"turns and num_system_prompts must be >= 1 and system_prompt_len "
                             f">= 0, got {self.turns}/{self.num_system_prompts}/"
                             f"{self.system_prompt_len}")
        for name in ("long_fraction", "structured_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("input_range", "output_range", "short_input_range", "short_output_range",
                     "long_input_range", "long_output_range"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {lo}:{hi}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"input_len/output_len must be >= 1, got "
                             f"{self.input_len}/{self.output_len}")


@dataclass
class RequestSpec:
    idx: int
    kind: str  # "fixed" | "uniform" | "short" | "long": metrics are also reported per kind
    prompt: str  # the user message
    num_prompt_words: int
    max_tokens: int
    system: str = ""  # a system message before it ("" = none)
    conversation: int = -1  # multi-turn: the conversation and turn of this request
    turn: int = 0
    arrival_s: float | None = None  # a trace's arrival (since its start); None = drawn
    structured: bool = False  # asks for STRUCTURED_SCHEMA output (a grammar on every token)

    @property
    def text(self) -> str:
        """The prompt's words as one text (system message first), what a mock engine takes."""
        return f"{self.system} {self.prompt}" if self.system else self.prompt


def _lengths(cfg: WorkloadConfig, rng: random.Random) -> tuple[str, int, int]:
    if cfg.dataset == "fixed":
        return "fixed", cfg.input_len, cfg.output_len
    if cfg.dataset == "uniform":
        return "uniform", rng.randint(*cfg.input_range), rng.randint(*cfg.output_range)
    if rng.random() < cfg.long_fraction:
        return "long", rng.randint(*cfg.long_input_range), rng.randint(*cfg.long_output_range)
    return "short", rng.randint(*cfg.short_input_range), rng.randint(*cfg.short_output_range)


def build_workload(cfg: WorkloadConfig, num_requests: int) -> list[RequestSpec]:
    """The same seed gives the same prompts and lengths, whatever the rate or the server.
    multi-turn: `num_requests` conversations of `cfg.turns` turns, in conversation order."""
    rng = random.Random(cfg.seed)
    if cfg.dataset == "multi-turn":
        system = words(rng, cfg.system_prompt_len)
        specs = []
        for conv in range(num_requests):
            for turn in range(cfg.turns):
                num_in = rng.randint(*cfg.short_input_range)
                specs.append(RequestSpec(len(specs), "turn", words(rng, num_in), num_in,
                                         rng.randint(*cfg.short_output_range), system, conv,
                                         turn))
        return specs
    systems = [words(rng, cfg.system_prompt_len) for _ in range(cfg.num_system_prompts)]
    specs = []
    for idx in range(num_requests):
        if cfg.dataset == "shared-prefix":
            num_in = rng.randint(*cfg.short_input_range)
            specs.append(RequestSpec(idx, "shared", words(rng, num_in), num_in,
                                     rng.randint(*cfg.short_output_range), rng.choice(systems)))
            continue
        kind, num_in, num_out = _lengths(cfg, rng)
        specs.append(RequestSpec(idx, kind, words(rng, num_in), num_in, num_out))
    return specs


def mark_structured(specs: list[RequestSpec], fraction: float, seed: int) -> list[RequestSpec]:
    """Draw which requests ask for structured output, from their own random stream: the prompts,
    lengths and arrivals are the same whatever the fraction."""
    if fraction > 0.0:
        rng = random.Random(seed + 104729)
        for spec in specs:
            spec.structured = rng.random() < fraction
    return specs


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after start at which each request is sent: Poisson process, or all at 0."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed + 7919)  # its own stream: the prompts do not depend on the rate
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out
