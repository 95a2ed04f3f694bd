"""`baton bench`: the serving benchmark (bench/serve_bench.py) under the `baton` command.

The benchmark lives in bench/, which is not an installed package (benchmarks are not library
code), so it is loaded by path: next to this package in a source checkout, else
./bench/serve_bench.py, else $BATON_BENCH_DIR/serve_bench.py. Where none exists (an installed
wheel without the sources), `baton bench` still parses and says where it looked.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_MODULE_NAME = "baton_serve_bench"


def bench_candidates() -> list[Path]:
    env = os.environ.get("BATON_BENCH_DIR", "")
    dirs = [Path(env)] if env else []
    dirs += [Path(__file__).resolve().parents[1] / "bench", Path.cwd() / "bench"]
    return [d / "serve_bench.py" for d in dirs]


def load_bench_module() -> ModuleType | None:
    if _MODULE_NAME in sys.modules:
        return sys.modules[_MODULE_NAME]
    for path in bench_candidates():
        if path.is_file():
            spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[_MODULE_NAME] = module  # dataclasses look their module up by name
            spec.loader.exec_module(module)
            return module
    return None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="serving benchmark against an OpenAI-compatible endpoint")
    module = load_bench_module()
    if module is None:
        p.set_defaults(func=_missing)
        return
    module.add_arguments(p)
    p.set_defaults(func=module.run)


def _missing(args: argparse.Namespace) -> int:
    looked = ", ".join(str(p) for p in bench_candidates())
    print(f"baton bench: bench/serve_bench.py not found (looked in {looked}); run it from a "
          "source checkout or set BATON_BENCH_DIR", file=sys.stderr)
    return 2
