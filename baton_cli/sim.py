"""`baton sim`: the simulator's command (simulator/cli.py), with the planner wired in here.

The planner (planner/core.py) sits a floor above the simulator (docs/architecture.md): it
predicts with the simulator, so the simulator must not import it. The composition root builds
it for `--planner advise|apply` and hands it to the run, which takes it by duck type.
"""

from __future__ import annotations

import argparse

from baton_cli.launch_config import add_planner_tuning, planner_tuning
from simulator import cli as sim_cli


def add_parser(sub: argparse._SubParsersAction) -> None:
    sim_cli.add_parser(sub)
    p = sub.choices["sim"]
    add_planner_tuning(p.add_argument_group("the planner's tuning (with --planner; the flags of "
                                            "baton up --planner)"))
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return sim_cli.run(args, make_planner=make_planner)


def make_planner(args: argparse.Namespace, profile, cfg):
    """The planner of `--planner advise|apply` for this run's profile and fleet."""
    from planner.core import Planner, PlannerConfig

    return Planner(profile, PlannerConfig(slos_ms=cfg.slos_ms, apply=args.planner == "apply",
                                          **planner_tuning(args)), cfg.fleet)
