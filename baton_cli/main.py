"""The `baton` command line: one subcommand per process role.

Each subcommand lives in its own module and registers itself in ``_SUBCOMMANDS``
as ``name -> "module:add_parser_function"``; the module is imported only when used,
so `baton --help` stays fast and a broken optional part does not break the rest.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module path, function that adds the subparser and sets `func`)
_SUBCOMMANDS: dict[str, str] = {
    "up": "baton_cli.launcher:add_parser",
    "generate": "baton_cli.generate:add_parser",
    "engine": "baton_cli.engine_args:add_normal_parser",
    "prompt-engine": "baton_cli.engine_args:add_prompt_parser",
    "completion-engine": "baton_cli.engine_args:add_completion_parser",
    "probe": "baton_cli.engine_args:add_probe_parser",
    "role": "baton_cli.engine_args:add_role_parser",
    "keys": "baton.ops.cluster_keys:add_generate_parser",
    "bench": "baton_cli.bench:add_parser",
    "sim": "baton_cli.sim:add_parser",
    "plan": "simulator.plan:add_parser",
    "planner": "baton_cli.planner_main:add_parser",
    "profile": "baton_cli.profile:add_parser",
    "router": "router.cli:add_parser",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with `only` (a subcommand's name) that subcommand's alone: an
    engine's start then imports no other subcommand's module (the simulator's pulls numpy and
    the profile code; `python -X importtime`)."""
    parser = argparse.ArgumentParser(prog="baton", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, target in _SUBCOMMANDS.items():
        if only is not None and name != only:
            continue
        module_name, func_name = target.split(":")
        getattr(importlib.import_module(module_name), func_name)(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The first word naming a subcommand is the command (--log-level's values never do).
    command = next((a for a in argv if a in _SUBCOMMANDS), None)
    args = build_parser(command).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
