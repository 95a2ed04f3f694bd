"""Benchmark records name paths inside the repository relative to it, never a host's folders
(tests/test_docs.py checks that no tracked file points outside the repository)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def relative_args(args: dict) -> dict:
    """`args` with every absolute path inside the repository made relative to it."""
    def rel(value):
        if isinstance(value, str) and Path(value).is_absolute() and \
                Path(value).resolve().is_relative_to(ROOT):
            return str(Path(value).resolve().relative_to(ROOT))
        return value
    return {k: rel(v) for k, v in args.items()}
