"""The workload flags `baton bench` and `baton sim` share, and the workload they build: a
synthetic dataset (`--dataset ...`) or a trace (`--trace`, which excludes `--dataset` and
`--request-rate`: the trace says what is sent and when)."""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict

from baton.workload.synthetic import (
    DATASETS,
    RequestSpec,
    WorkloadConfig,
    arrival_offsets,
    build_workload,
    mark_structured,
)
from baton.workload.trace import TraceConfig, build_trace_workload


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI or N, got {text!r}") from None


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    w = WorkloadConfig()
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default=None, choices=list(DATASETS),
                   help=f"synthetic workload (default {w.dataset}); excludes --trace")
    g.add_argument("--trace", default="",
                   help="replay a Mooncake jsonl trace (timestamp ms, input_length, "
                        "output_length, hash_ids); excludes --dataset and --request-rate")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="--trace: multiply every arrival time (> 1 slows arrivals)")
    g.add_argument("--length-scale", type=float, default=1.0,
                   help="--trace: multiply input and output lengths (a 512-token hash block "
                        "becomes round(512 * Y) tokens)")
    g.add_argument("--spread-bursts", action="store_true",
                   help="--trace: requests sharing a timestamp arrive evenly over the time to "
                        "the next one, in file order (Mooncake's timestamps are 3 s bins: "
                        "kept, every bin is a burst)")
    g.add_argument("--turns", type=int, default=w.turns,
                   help="multi-turn: turns per conversation (--num-requests conversations)")
    g.add_argument("--system-prompt-len", type=int, default=w.system_prompt_len,
                   help="multi-turn, shared-prefix: words of each system prompt")
    g.add_argument("--num-system-prompts", type=int, default=w.num_system_prompts,
                   help="shared-prefix: how many system prompts the requests share")
    g.add_argument("--seed", type=int, default=w.seed)
    g.add_argument("--input-len", type=int, default=w.input_len, help="fixed: prompt words")
    g.add_argument("--output-len", type=int, default=w.output_len, help="fixed: output tokens")
    for name, default in (("input-range", w.input_range), ("output-range", w.output_range),
                          ("short-input-range", w.short_input_range),
                          ("short-output-range", w.short_output_range),
                          ("long-input-range", w.long_input_range),
                          ("long-output-range", w.long_output_range)):
        g.add_argument(f"--{name}", type=_range, default=default, metavar="LO:HI")
    g.add_argument("--long-fraction", type=float, default=w.long_fraction,
                   help="mix: share of long prompts among the chat traffic")
    g.add_argument("--structured-fraction", type=float, default=w.structured_fraction,
                   help="any workload, a trace too: share of requests asking for JSON-schema "
                        "output (a grammar on every token; docs/profile.md grammar_row_ms)")


def workload_from_args(args: argparse.Namespace) -> tuple[WorkloadConfig, TraceConfig | None]:
    """The synthetic config (its seed is used either way) and the trace's, if any.
    ValueError for flags that exclude each other or that the other workload would ignore."""
    workload = WorkloadConfig(
        dataset=args.dataset or WorkloadConfig.dataset, seed=args.seed,
        input_len=args.input_len, output_len=args.output_len, input_range=args.input_range,
        output_range=args.output_range, short_input_range=args.short_input_range,
        short_output_range=args.short_output_range, long_fraction=args.long_fraction,
        long_input_range=args.long_input_range, long_output_range=args.long_output_range,
        turns=args.turns, system_prompt_len=args.system_prompt_len,
        num_system_prompts=args.num_system_prompts,
        structured_fraction=args.structured_fraction)
    if not args.trace:
        if args.time_scale != 1.0 or args.length_scale != 1.0 or args.spread_bursts:
            raise ValueError("--time-scale, --length-scale and --spread-bursts apply to "
                             "--trace only")
        return workload, None
    if args.dataset is not None:
        raise ValueError("--trace and --dataset exclude each other")
    if not math.isinf(args.request_rate):
        raise ValueError("--trace and --request-rate exclude each other (the trace's "
                         "timestamps are the arrivals; --time-scale scales them)")
    return workload, TraceConfig(args.trace, args.num_requests, args.time_scale,
                                 args.length_scale, args.spread_bursts)


def build_specs(workload: WorkloadConfig, trace: TraceConfig | None,
                num_requests: int) -> list[RequestSpec]:
    specs = build_trace_workload(trace) if trace is not None else \
        build_workload(workload, num_requests)
    return mark_structured(specs, workload.structured_fraction, workload.seed)


def unit_arrivals(units: list[list[RequestSpec]], rate: float, seed: int) -> list[float]:
    """Seconds after start at which each unit (a request, or a conversation's first turn) is
    sent: the trace's own arrivals, else Poisson at `rate`."""
    if units and units[0][0].arrival_s is not None:
        return [float(u[0].arrival_s) for u in units]
    return arrival_offsets(len(units), rate, seed)


def workload_record(workload: WorkloadConfig, trace: TraceConfig | None) -> dict:
    """The result JSON's `workload` section."""
    if trace is None:
        return asdict(workload)
    return {"dataset": "trace", "seed": workload.seed,
            "structured_fraction": workload.structured_fraction, **asdict(trace)}
