"""The layering of docs/architecture.md, enforced: every import (module top or inside a function)
goes to the same floor or one below, roles never import each other, no import cycle, the router
loads no torch and the engine core imports without torch.

A new package must be placed on a floor here (the test fails on a module it cannot place)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bottom to top; a module's floor is the one of its longest matching prefix. The same table is
# drawn in docs/architecture.md.
FLOORS: list[tuple[str, ...]] = [
    ("kv_transfer",),
    ("baton", "baton.protocol", "baton.tokenizer", "baton.model_files"),
    ("baton.sampling",),
    ("baton.model",),
    ("baton.engine",),
    ("baton.workload", "baton.perf"),
    ("baton.ops",),
    ("baton.service",),
    ("normal_engine", "prompt_engine", "completion_engine", "router"),
    ("simulator",),
    ("planner",),
    ("baton_cli",),
]
PACKAGES = ("kv_transfer", "baton", "normal_engine", "prompt_engine", "completion_engine",
            "router", "simulator", "planner", "baton_cli")
# Siblings on one floor that must not import each other (roles plug into the engine, the router
# talks to them over the wire).
SIBLINGS = ("normal_engine", "prompt_engine", "completion_engine", "router")


def floor_of(module: str) -> int:
    best, floor = -1, None
    for i, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), i
    assert floor is not None, f"{module} is on no floor of tests/test_layering.py"
    return floor


def project_modules() -> dict[str, Path]:
    mods = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join(parts)] = path
    return mods


def imports_of(module: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Project modules `module` imports anywhere in its file."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                     for a in node.names]
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = project_modules()
    return {m: imports_of(m, p, mods) for m, p in mods.items()}


def test_every_import_goes_down_or_across_a_floor():
    bad = []
    for module, deps in import_graph().items():
        for dep in deps:
            if floor_of(dep) > floor_of(module):
                bad.append(f"{module} (floor {floor_of(module)}) imports {dep} "
                           f"(floor {floor_of(dep)})")
            top, dep_top = module.split(".")[0], dep.split(".")[0]
            if top in SIBLINGS and dep_top in SIBLINGS and top != dep_top:
                bad.append(f"{module} imports its sibling {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_cycle():
    graph = import_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles = []

    def strong(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            strong(v)
    assert not cycles, cycles


def test_only_the_engine_core_names_its_scheduler():
    bad = [m for m, deps in import_graph().items()
           if "baton.engine.scheduler" in deps and not m.startswith("baton.engine")]
    assert not bad, bad


def _loads(statement: str) -> list[str]:
    probe = f"import sys; {statement}; print(','.join(m for m in ('torch',) if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return [m for m in out.stdout.strip().split(",") if m]


def test_router_loads_no_torch():
    assert _loads("import router.app, router.cli") == []


def test_simulator_loads_no_torch():
    assert _loads("import simulator.fleet, baton.perf.mock_runner, baton.workload.args") == []


def test_engine_core_imports_without_torch():
    assert _loads("import baton.engine, baton.engine.block_keys, baton.sampling.params, "
                  "baton.sampling.samples, baton.model.modes") == []
