"""The installed CLI starts and offers every role (the compiled scheduler is driven by
tests/scheduler/, e.g. test_walkthrough.py)."""

from __future__ import annotations

import re
import subprocess
import sys


def test_cli_starts_and_lists_every_role() -> None:
    done = subprocess.run([sys.executable, "-m", "baton_cli", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    choices = re.search(r"\{([a-z,-]+)\}", done.stdout)
    assert choices, done.stdout
    assert set(choices.group(1).split(",")) == {
        "up", "engine", "prompt-engine", "completion-engine", "router", "probe", "generate",
        "bench", "sim", "profile", "keys", "plan", "planner", "role"}
