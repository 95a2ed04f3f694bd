from __future__ import annotations


def test_cli_lists_every_role() -> None:
    from baton.cli import build_parser

    help_text = build_parser().format_help()
    for command in ("up", "engine", "prompt-engine", "completion-engine", "router", "probe",
                    "generate", "bench"):
        assert command in help_text
