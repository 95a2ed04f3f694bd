"""`baton sim`: size a fleet on this machine's profile, in virtual time.

    baton sim --profile P.json --trace T.jsonl --time-scale 4 --length-scale 0.25 \
        --prompt-engines 2 --completion-engines 2 --goodput ttft:2000 tpot:100 \
        --label pd2x2 --results-dir bench/results

Writes the same record and table as `baton bench` (serve_<label>_<time>.json) with a `fleet`
section (per engine: busy time, pulled KV bytes, prefix-cache hit rate; the paths taken).

A mixed fleet (`--normal-engines N` beside `--prompt-engines` and `--completion-engines`)
chooses each request's path with the router's path policy (router/path.py): the profile's
predicted costs, or `--pd-threshold-tokens N` as the router's flag.

`--planner` needs a planner (planner/core.py, a floor above this one): the composition root
builds it (baton_cli/sim.py) and hands `run` a factory; the simulator takes it by duck type.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path

from baton.engine.config import SERVE_MAX_NUM_BATCHED_TOKENS
from baton.perf.profile import ProfileError
from baton.perf.profile import load as load_profile
from baton.workload.args import add_workload_arguments, workload_from_args
from baton.workload.results import format_table, parse_slos, write_result
from baton.workload.trace import TraceError
from router.path import DEFAULT_HANDOFF_MS

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulate a fleet in virtual time on a measured profile")
    p.add_argument("--profile", required=True, help="profile JSON (`baton profile --out`)")
    g = p.add_argument_group("fleet")
    g.add_argument("--normal-engines", type=int, default=None,
                   help="co-located engines (default 1 unless prompt/completion engines given)")
    g.add_argument("--prompt-engines", type=int, default=0)
    g.add_argument("--completion-engines", type=int, default=0)
    g.add_argument("--num-blocks", type=int, default=0,
                   help="KV blocks per engine (default: the profiled engine's)")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=SERVE_MAX_NUM_BATCHED_TOKENS,
                   help="a prompt step's token budget (default: `baton engine`'s)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--prepare-workers", type=int, default=2,
                   help="the router's --prepare-workers: where bodies over 8 KiB are prepared "
                        "(the profile's prepare cost; default 2, the router's)")
    g.add_argument("--engines-per-host", type=int, default=1, metavar="N",
                   help="engines a host holds, filled in order (normal, prompt, completion): "
                        "engines of one host slow each other's steps by the profile's "
                        "contention (`baton profile` measures it); default 1, each engine on "
                        "its own host")
    g.add_argument("--service-cores", type=int, default=0, metavar="N",
                   help="the router and the clients on the first host, a machine of N cores "
                        "(one per engine of it, the rest idle): their CPU for the engines' "
                        "outputs (the profile's path.service_*_ms) is taken from the host's "
                        "busy engines when no core is idle; default 0, on machines of their own")
    g.add_argument("--routing", choices=("cache-aware", "least-loaded"), default="cache-aware",
                   help="the router's selection policy (router/selection.py), as `baton up`")
    g.add_argument("--kv-overlap-weight", type=float, default=1.0,
                   help="routing cost of a prompt block an engine lacks (router's default 1)")
    g.add_argument("--link-gbit", type=float, default=0.0,
                   help="KV pulls over a link of this many Gbit/s (default: the profile's)")
    g.add_argument("--link-latency-ms", type=float, default=0.0,
                   help="with --link-gbit: the fixed time of one pull")
    g = p.add_argument_group("path choice (router/path.py; a mixed fleet: normal engines "
                             "beside prompt and completion engines)")
    g.add_argument("--pd-threshold-tokens", type=int, default=None, metavar="N",
                   help="a static rule, as the router's: disaggregated when a normal engine "
                        "would prefill more than N prompt tokens (its cached prefix left out); "
                        "default: the path of the lower predicted cost on --profile")
    g.add_argument("--pd-handoff-ms", type=float, default=None,
                   help="the predicted disaggregated path's cost beyond the KV copy, ms "
                        "(the router's flag; default: the profile's path.handoff_ms, else "
                        f"{DEFAULT_HANDOFF_MS:g})")
    g = p.add_argument_group("planner (planner/core.py; a prompt/completion fleet)")
    g.add_argument("--planner", choices=("off", "advise", "apply"), default="off",
                   help="advise: record its decisions; apply: also re-role engines (S41)")
    g.add_argument("--engines", type=int, default=0,
                   help="with --planner: the budget; the start is --prompt-engines and "
                        "--completion-engines if given, else half and half")
    # its --planner-interval, --planner-window, ...: the composition root's (baton_cli/sim.py)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests/s with Poisson arrivals (default inf: all at once)")
    g.add_argument("--num-requests", type=int, default=40,
                   help="synthetic: requests (multi-turn: conversations); --trace: the first N")
    g.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS")
    add_workload_arguments(p)
    g = p.add_argument_group("output")
    g.add_argument("--label", default="sim")
    g.add_argument("--results-dir", default="bench/results")
    p.set_defaults(func=run)


def configs_from_args(args: argparse.Namespace):
    from simulator.fleet import FleetConfig
    from simulator.run import SimConfig

    if args.planner != "off":
        if not args.engines or args.engines < 2:
            raise ValueError("--planner needs --engines N (N >= 2): the budget it splits")
        if args.normal_engines:
            raise ValueError("--planner moves engines between prompt and completion: no "
                             "--normal-engines")
        if not (args.prompt_engines or args.completion_engines):
            args.prompt_engines = args.engines // 2
            args.completion_engines = args.engines - args.engines // 2
        if args.prompt_engines + args.completion_engines != args.engines:
            raise ValueError(f"--prompt-engines {args.prompt_engines} + --completion-engines "
                             f"{args.completion_engines} must make --engines {args.engines}")
        if not args.goodput:
            raise ValueError("--planner needs --goodput SLOs: it maximises goodput")
    elif args.engines:
        raise ValueError("--engines is the planner's budget: give --planner advise|apply")
    disagg = args.prompt_engines or args.completion_engines
    normal = args.normal_engines if args.normal_engines is not None else (0 if disagg else 1)
    fleet = FleetConfig(num_normal=normal, num_prompt=args.prompt_engines,
                        num_completion=args.completion_engines, num_blocks=args.num_blocks,
                        max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        enable_prefix_caching=not args.no_prefix_caching,
                        num_prepare_workers=args.prepare_workers,
                        engines_per_host=args.engines_per_host,
                        service_cores=args.service_cores)
    if args.link_latency_ms and not args.link_gbit:
        raise ValueError("--link-latency-ms needs --link-gbit")
    cfg = SimConfig(fleet=fleet, request_rate=args.request_rate,
                    num_requests=args.num_requests, slos_ms=parse_slos(args.goodput),
                    kv_overlap_weight=args.kv_overlap_weight, label=args.label,
                    routing=args.routing, pd_threshold_tokens=args.pd_threshold_tokens,
                    pd_handoff_ms=args.pd_handoff_ms)
    workload, trace = workload_from_args(args)
    return cfg, workload, trace


# (the parsed flags, the profile, the run's config) -> a planner (planner/core.py's Planner)
MakePlanner = Callable[[argparse.Namespace, object, object], object]


def run(args: argparse.Namespace, make_planner: MakePlanner | None = None) -> int:
    """`baton sim`; with `--planner advise|apply`, `make_planner` builds the planner."""
    from simulator.run import simulate

    try:
        profile = load_profile(args.profile)
        if args.link_gbit:
            profile = profile.with_link(args.link_gbit, args.link_latency_ms)
        cfg, workload, trace = configs_from_args(args)
        planner = None
        if args.planner != "off":
            if make_planner is None:
                raise ValueError("--planner needs the planner: run it as `baton sim`")
            planner = make_planner(args, profile, cfg)
        record = simulate(profile, cfg, workload, trace, planner=planner)
    except (ProfileError, TraceError, ValueError) as exc:
        print(f"baton sim: {exc}", file=sys.stderr)
        return 2
    print(format_table(record))
    busy = ", ".join(f"{e['name']} {100 * e['busy_fraction']:.0f}%"
                     for e in record["fleet"]["engines"][:16])
    print(f"busy: {busy}; simulated {record['fleet']['virtual_s']:.1f} s in "
          f"{record['sim_wall_s']:.1f} s")
    if cfg.fleet.is_mixed:
        print("paths: " + ", ".join(f"{p['path']} ({p['reason']}) {p['count']}"
                                    for p in record["fleet"]["path_total"]))
    if "roles_over_time" in record["fleet"]:
        changes = [d for d in record["fleet"]["planner_decisions"] if d["action"] == "change"]
        print(f"planner ({args.planner}): {len(changes)} changes: " + ", ".join(
            f"{d['target']} at {d['t']:.0f} s" for d in changes))
    path = write_result(record, Path(args.results_dir))
    print(f"wrote {path}")
    return 0 if record["summary"]["num_completed"] else 1

