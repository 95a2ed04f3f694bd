"""Trace replay: Mooncake's jsonl format, one request a line.

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

`timestamp` is the arrival in ms since the trace's start, the lengths are tokens, `hash_ids`
one id per 512-token block of the prompt (equal ids: equal content, everything before included).
Replay builds a prompt of words whose blocks follow the ids: block `h` is the same words
wherever it appears (drawn from a generator seeded by `h` alone), so the trace's prefix reuse is
real on any engine. `time_scale` multiplies every arrival (> 1 slows the trace down);
`length_scale` multiplies both lengths, a hash block becoming round(512 * length_scale) words
(at least 1).

Mooncake's timestamps are bins, not arrivals: in the conversation trace's first half (6,015
requests) there are 628 distinct timestamps, every gap between them 3,000 +- 1 ms, ~9.6 requests
a bin (up to 23). Replayed as written, every bin is a burst of simultaneous requests, an
overload at any mean rate. `spread_bursts` spreads the requests of one timestamp evenly over the
time to the next distinct one (the last bin over the trace's median gap), in file order: the
same requests and mean rate, arrivals as the bins suggest they came.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from baton.workload.synthetic import RequestSpec
from baton.workload.words import WORDS

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file and the line."""


@dataclass
class TraceConfig:
    path: str
    num_requests: int = 0  # the first N lines; 0 = all
    time_scale: float = 1.0  # multiplies every arrival time (> 1: slower arrivals)
    length_scale: float = 1.0  # multiplies input and output lengths and the hash block
    spread_bursts: bool = False  # one timestamp's requests spread to the next (module doc)

    def __post_init__(self) -> None:
        if self.num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {self.num_requests}")
        for name in ("time_scale", "length_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0, got {value}")

    @property
    def block_words(self) -> int:
        return max(1, round(TRACE_BLOCK_TOKENS * self.length_scale))


@dataclass
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


def read_records(cfg: TraceConfig) -> list[TraceRecord]:
    """The trace's first `num_requests` records, checked; TraceError names the bad line."""
    records: list[TraceRecord] = []
    try:
        handle = open(cfg.path, encoding="utf-8")  # noqa: SIM115 - closed below
    except OSError as exc:
        raise TraceError(f"{cfg.path}: cannot read the trace: {exc}") from None
    with handle:
        for lineno, line in enumerate(handle, 1):
            if cfg.num_requests and len(records) >= cfg.num_requests:
                break
            if not line.strip():
                continue
            try:
                records.append(_record(line))
            except ValueError as exc:
                raise TraceError(f"{cfg.path}:{lineno}: {exc}") from None
            if len(records) > 1 and records[-1].timestamp_ms < records[-2].timestamp_ms:
                raise TraceError(f"{cfg.path}:{lineno}: timestamp {records[-1].timestamp_ms} "
                                 f"before the previous line's {records[-2].timestamp_ms}")
    if not records:
        raise TraceError(f"{cfg.path}: no requests in the trace")
    return records


def _record(line: str) -> TraceRecord:
    try:
        d = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"a JSON object wanted, got {type(d).__name__}")
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in d:
            raise ValueError(f"missing field {key!r}")
    ts = d["timestamp"]
    if not _is_int(ts) and not (isinstance(ts, float) and math.isfinite(ts)) or ts < 0:
        raise ValueError(f"field 'timestamp' must be a number of ms >= 0, got {ts!r}")
    for key in ("input_length", "output_length"):
        if not _is_int(d[key]) or d[key] < 1:
            raise ValueError(f"field {key!r} must be an int >= 1, got {d[key]!r}")
    ids = d["hash_ids"]
    if not isinstance(ids, list) or not all(_is_int(h) and h >= 0 for h in ids):
        raise ValueError(f"field 'hash_ids' must be a list of ints >= 0, got {ids!r}"[:200])
    need = math.ceil(d["input_length"] / TRACE_BLOCK_TOKENS)
    if len(ids) != need:
        raise ValueError(f"field 'hash_ids' must hold ceil(input_length / 512) = {need} ids "
                         f"(input_length {d['input_length']}), got {len(ids)}")
    return TraceRecord(float(ts), d["input_length"], d["output_length"], list(ids))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class _Blocks:
    """Block `h`'s words, drawn once per hash id."""

    def __init__(self, num_words: int) -> None:
        self.num_words = num_words
        self._cache: dict[int, list[str]] = {}

    def __call__(self, hash_id: int) -> list[str]:
        block = self._cache.get(hash_id)
        if block is None:
            rng = random.Random(hash_id)
            block = self._cache[hash_id] = [rng.choice(WORDS) for _ in range(self.num_words)]
        return block


def build_trace_workload(cfg: TraceConfig) -> list[RequestSpec]:
    """The trace's requests, arrivals (`RequestSpec.arrival_s`) and prompts scaled."""
    blocks = _Blocks(cfg.block_words)
    specs = []
    records = read_records(cfg)
    arrivals_ms = (spread_bursts([r.timestamp_ms for r in records]) if cfg.spread_bursts
                   else [r.timestamp_ms for r in records])
    for idx, (rec, arrival_ms) in enumerate(zip(records, arrivals_ms, strict=True)):
        num_in = max(1, round(rec.input_length * cfg.length_scale))
        prompt: list[str] = []
        for h in rec.hash_ids:
            if len(prompt) >= num_in:
                break
            prompt.extend(blocks(h))
        del prompt[num_in:]
        specs.append(RequestSpec(idx, "trace", " ".join(prompt), num_in,
                                 max(1, round(rec.output_length * cfg.length_scale)),
                                 arrival_s=arrival_ms / 1e3 * cfg.time_scale))
    return specs


def spread_bursts(timestamps_ms: list[float]) -> list[float]:
    """Arrivals (ms) with each run of equal timestamps spread evenly over the gap to the next
    distinct one (the last run over the median gap; a trace of one timestamp stays a burst)."""
    distinct = sorted(set(timestamps_ms))
    gaps = [b - a for a, b in itertools.pairwise(distinct)]
    last_gap = sorted(gaps)[len(gaps) // 2] if gaps else 0.0
    next_of = dict(zip(distinct, [*distinct[1:], distinct[-1] + last_gap], strict=True))
    out: list[float] = []
    for t, run in itertools.groupby(timestamps_ms):
        n = len(list(run))
        out.extend(t + k * (next_of[t] - t) / n for k in range(n))
    return out


def write_window(src: str | Path, dst: str | Path, num_lines: int) -> None:
    """The first `num_lines` lines of a trace (a window to commit beside the tests)."""
    with open(src, encoding="utf-8") as f:
        lines = [next(f) for _ in range(num_lines)]
    Path(dst).write_text("".join(lines))
