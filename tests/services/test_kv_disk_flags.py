"""The disk tier's flags: every engine command takes them, `baton up` hands each engine its own
sub-folder, and a misplaced or bad value is refused by name (README: KV tiers)."""

from __future__ import annotations

import argparse
import os

import pytest

from baton_cli.engine_args import parse_bytes
from baton_cli.engine_main import engine_config
from baton_cli.launcher import LaunchConfig, Launcher
from baton_cli.main import build_parser


@pytest.mark.parametrize("command", ["engine", "prompt-engine", "completion-engine"])
def test_every_engine_command_takes_the_disk_flags(command: str) -> None:
    args = build_parser().parse_args([command, "--kv-disk-dir", "/var/kv", "--kv-disk-bytes",
                                      "2G"])
    config = engine_config(args, args.role)
    assert config.kv_disk_dir == "/var/kv" and config.kv_disk_bytes == 2 << 30


def test_sizes_and_refusals() -> None:
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("1.5G") == 3 << 29
    assert parse_bytes("4096") == 4096 and parse_bytes("8gb") == 8 << 30
    for bad in ("lots", "0", "-1G"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="prefix caching off"):
        from baton.engine import EngineConfig

        EngineConfig(kv_disk_dir="/x", enable_prefix_caching=False)


def test_baton_up_gives_each_engine_its_own_folder(tmp_path) -> None:
    launcher = Launcher(LaunchConfig(kv_disk_dir=str(tmp_path), kv_disk_bytes=1 << 30))
    off = Launcher(LaunchConfig())
    try:  # _start_engine spawns the engine: stop them, so that no child outlives the test
        for command, engine_id in (("prompt-engine", "prompt-0"), ("completion-engine",
                                                                   "completion-0")):
            launcher._start_engine(command, engine_id, 1, "")
        for child in launcher.children:
            argv = child.argv
            folder = argv[argv.index("--kv-disk-dir") + 1]
            assert folder == os.path.join(str(tmp_path), child.name)
            assert argv[argv.index("--kv-disk-bytes") + 1] == str(1 << 30)
        off._start_engine("prompt-engine", "p", 1, "")
        assert "--kv-disk-dir" not in off.children[0].argv
    finally:
        launcher.stop()
        off.stop()
    with pytest.raises(ValueError, match="give --kv-disk-dir to `baton up` itself"):
        LaunchConfig(engine_args=["--kv-disk-dir", "/x"])
    with pytest.raises(ValueError, match="give --kv-disk-dir too"):
        LaunchConfig(kv_disk_bytes=1 << 30)
