"""`baton profile --out P.json [--quick] [--no-path | --router-only | --refit OLD.json]
[--no-contention]`: measure this machine's engine (baton/perf/measure.py; last, how a second
engine of the model on this host slows its steps: baton/perf/contention.py), then the serving
path's own latency on mock engines of the new profile (simulator/calibrate.py).
`--router-only` measures the router's side alone (its prepare with the model's tokenizer, and
the path) into an existing profile: what a profile measured on another machine (tests/data's,
a GPU host's) needs to predict mock engines here. `--refit OLD.json` measures nothing: OLD's
step costs fitted again, with this version's features, to the grid points OLD keeps
(`machine.grid`), written to --out."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure this machine's engine costs into a profile JSON")
    p.add_argument("--out", required=True, help="where the profile goes")
    p.add_argument("--quick", action="store_true", help="a smaller grid (about a minute)")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default SmolLM2)")
    p.add_argument("--quantization", default="auto", help="none | int8 | int4 | auto")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: leaves the other cores to others)")
    path = p.add_mutually_exclusive_group()
    path.add_argument("--no-path", action="store_true",
                      help="skip the serving path's measurement (mock engines behind the "
                           "router, ~15 s): the simulator then adds no path latency")
    path.add_argument("--router-only", action="store_true",
                      help="measure only the router's side (its prepare with --model's "
                           "tokenizer, and the serving path) into the existing --out profile")
    path.add_argument("--refit", default="", metavar="OLD.json",
                      help="measure nothing: OLD's prompt-step and decode-step costs fitted "
                           "again to the grid points it keeps, with this version's features "
                           "(its other costs and its path as measured), written to --out")
    p.add_argument("--no-contention", action="store_true",
                   help="skip how a second engine of the model on this host slows this one's "
                        "steps (~40 s): `baton sim --engines-per-host` then refuses the "
                        "profile")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from baton.perf.contention import QUICK_CONTENTION, ContentionGrid
    from baton.perf.measure import QUICK, Grid, measure, prepare_cost
    from baton.perf.profile import ProfileError, load, refit, save

    if args.threads < 1:
        print(f"baton profile: --threads must be >= 1, got {args.threads}", file=sys.stderr)
        return 2
    if args.refit:
        if _refused(args, "--refit measures nothing",
                    ("--quick", "--model", "--threads", "--quantization", "--no-contention")):
            return 2
        try:
            prof = refit(load(args.refit))
        except ProfileError as exc:
            print(f"baton profile: {args.refit}: {exc}", file=sys.stderr)
            return 2
        save(prof, args.out)
        _print_fits(prof)
        print(f"wrote {args.out}")
        return 0
    if args.router_only:
        from router.text import load_model_info

        # The engine's flags: no engine runs here (the tokenizer of --model only).
        if _refused(args, "--router-only runs no engine",
                    ("--threads", "--quantization", "--no-contention")):
            return 2

        try:
            prof = load(args.out)
        except ProfileError as exc:
            print(f"baton profile: {exc}", file=sys.stderr)
            return 2
        prof = replace(prof, prepare=prepare_cost(load_model_info(args.model or "").tokenizer,
                                                  QUICK if args.quick else Grid()))
        save(prof, args.out)
    else:
        contention = None if args.no_contention else (
            QUICK_CONTENTION if args.quick else ContentionGrid())
        prof = measure(args.model, args.quantization, args.threads,
                       QUICK if args.quick else Grid(), contention=contention)
        save(prof, args.out)
    if not args.no_path:
        try:
            prof = _with_path(prof, args.out)
        except (RuntimeError, OSError, httpx.HTTPError) as exc:  # the grid is kept
            print(f"baton profile: the serving path was not measured ({exc}); {args.out} "
                  f"holds the rest: `baton profile --out {args.out} --router-only` tries again",
                  file=sys.stderr)
            return 1
        save(prof, args.out)
    if args.router_only:
        print(f"prepare: {prof.prepare.coef[0]:.3f} ms + {prof.prepare.coef[1]:.5f} ms a token")
        print(f"wrote {args.out}")
        return 0
    _print_fits(prof)
    _print_drift(prof)
    if prof.contention is not None:
        c = prof.contention
        print(f"contention (a second engine on this host): beside its prompt steps, a decode "
              f"step of one row x{c.decode_beside_prefill:.3f}, of several "
              f"x{c.batch_decode_beside_prefill:.3f}; a prompt step beside its decode steps "
              f"x{c.prefill_beside_decode:.3f}")
    if prof.admit is not None:
        print(f"a decode row new to its engine (a pulled request's first step): "
              f"{prof.admit_ms(0):.3f} ms + {prof.admit.coef[1] * 1e3:.3f} ms per 1000 tokens "
              f"of its context")
    print(f"sampling: {prof.sample_row_ms:.3f} ms/row + {prof.step_overhead_ms:.3f} ms/step, "
          f"a grammar row {prof.grammar_row_ms:.3f} ms more; "
          f"transfer {prof.transfer_latency_ms:.3f} ms + {prof.transfer_bytes_per_ms / 1e6:.2f} "
          f"GB/s; engine start {prof.engine_start_s:.1f} s")
    print(f"wrote {args.out}")
    return 0


def _refused(args: argparse.Namespace, mode: str, flags: tuple[str, ...]) -> bool:
    """Whether any of `flags` (the measuring ones, which `mode` does not use) was given; if
    so, says so by name."""
    given = {"--quick": args.quick, "--model": bool(args.model),
             "--threads": args.threads != 1, "--quantization": args.quantization != "auto",
             "--no-contention": args.no_contention}
    ignored = [flag for flag in flags if given[flag]]
    if ignored:
        print(f"baton profile: {mode}; {' and '.join(ignored)} would do nothing",
              file=sys.stderr)
    return bool(ignored)


def _print_fits(prof) -> None:
    for name, cost in (("prefill", prof.prefill), ("decode", prof.decode)):
        print(f"{name}: {dict(zip(cost.features, (round(c, 4) for c in cost.coef), strict=True))}"
              f" held-out error mean {100 * cost.fit.mean_rel_err:.1f}% "
              f"max {100 * cost.fit.max_rel_err:.1f}% ({cost.fit.num_held_out} points)")


# How far the prefill grid's last pass may move from its first before `baton profile` says
# the host's speed moved under the measurement (this host: 10-30% within an hour).
DRIFT_WARN = 0.10


def _print_drift(prof) -> None:
    passes = prof.machine.get("prefill_passes")
    if not passes or len(passes["total_ms"]) < 2:
        return
    drift = passes["drift"]
    print(f"prefill grid: its last pass x{drift:.3f} its first (median over the steps; the "
          f"passes minutes apart, both fitted)")
    if abs(drift - 1.0) > DRIFT_WARN:
        print(f"baton profile: the host's speed moved under the measurement (x{drift:.3f} "
              f"between passes of the same prompt steps): the fit averages the moments; "
              f"measured again at a steadier time, the profile may predict better",
              file=sys.stderr)


def _with_path(prof, out: str):
    """The profile with its serving path measured on mock engines of the profile in `out`."""
    import logging

    from simulator.calibrate import calibrate_path

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    cost, _ = calibrate_path(out)
    print(f"serving path: {cost.request_ms:.2f} ms a request, a hand-off "
          f"{cost.handoff_ms:.2f} ms beyond the pull, the engine loop's own work "
          f"{cost.step_gap_ms:.3f} ms a step ({cost.num_requests} lone requests on mock "
          f"engines); the router's and a client's CPU {cost.service_step_ms:.3f} ms a step "
          f"that emits and {cost.service_token_ms:.3f} ms a token")
    return replace(prof, path=cost)
