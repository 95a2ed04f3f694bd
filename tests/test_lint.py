"""The strict ruff settings in pyproject.toml hold for the whole tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed in this environment (pip install -e '.[dev]')")
    result = subprocess.run([str(ruff), "check", "--no-cache", str(ROOT)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:]
