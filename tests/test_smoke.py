from __future__ import annotations


def test_extension_imports() -> None:
    from baton import _scheduler

    assert _scheduler.__doc__
