"""The disk tier through real processes (`baton up --kv-disk-dir`, mock engines: the real engine
loop, scheduler and disk tier, only the model replaced): each engine writes to its own
sub-folder, and an engine the launcher restarts serves the first returning prompt from disk."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from baton.workload.words import WORDS
from tests.sim.test_mock_engines import _start

pytestmark = pytest.mark.slow  # a multi-process deployment


def _ask(client, model: str, content: str):
    resp = client.chat.completions.create(model=model, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": content}])
    return resp.choices[0].message.content, resp.usage.prompt_tokens_details.cached_tokens


def _engine_pid(proc: subprocess.Popen) -> int:
    for child in psutil.Process(proc.pid).children():
        if "normal-0" in child.cmdline():
            return child.pid
    raise AssertionError("no engine process")


def test_p10_a_restarted_engine_serves_the_returning_prompt_from_disk(tmp_path: Path) -> None:
    from openai import OpenAI

    up = _start(["--normal-engines", "1", "--kv-disk-dir", str(tmp_path)],
                engine_flags=["--num-blocks", "16"])
    proc = up.proc
    try:
        client = OpenAI(base_url=f"{up.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        model = client.models.list().data[0].id
        a = " ".join(WORDS[j % len(WORDS)] for j in range(120))
        b = " ".join(WORDS[(j * 7 + 3) % len(WORDS)] for j in range(120))
        first, _ = _ask(client, model, a)
        _ask(client, model, b)  # pushes a's blocks out of the 15-block pool, to disk
        old = _engine_pid(proc)
        psutil.Process(old).send_signal(signal.SIGTERM)  # drains, writes its pool to disk
        deadline = time.monotonic() + 60
        while True:  # the launcher restarts it under the same id, over the same folder
            try:
                if _engine_pid(proc) != old:
                    again, cached = _ask(client, model, a)
                    break
            except Exception:  # noqa: BLE001 (not back yet: the router answers 503)
                pass
            assert time.monotonic() < deadline, up.tail()
            time.sleep(0.5)
        assert again == first and cached > 0
        assert list((tmp_path / "normal-0").glob("*.kvd")), list(tmp_path.iterdir())
        assert any("KV tiers: pool" in line for line in up.stderr.lines)
    finally:
        up.stop()
