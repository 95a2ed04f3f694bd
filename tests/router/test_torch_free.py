"""The router never loads torch: it reads the tokenizer and limits from the model's metadata
(baton/model_files.py, baton/tokenizer.py), never through the model runtime (baton/model).

Each check runs in a fresh interpreter, since this test process may have imported torch already.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

# `baton router` as the CLI runs it, with uvicorn.run swapped for a client that drives the same app
# through its lifespan (the model's tokenizer is loaded there) and one request.
_ROUTER_PROCESS = textwrap.dedent("""
    import sys
    import uvicorn
    from fastapi.testclient import TestClient

    def run(app, **_):
        with TestClient(app) as client:
            print("models", client.get("/v1/models").status_code)

    uvicorn.run = run
    from baton_cli.main import main
    code = main(["--log-level", "WARNING", "router", "--engine", "normal=tcp://127.0.0.1:9"])
    print("exit", code)
    print("torch", "torch" in sys.modules)
""")


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.split("\n")


def test_importing_the_router_app_does_not_load_torch():
    assert _run("import sys, router.app; print('torch' in sys.modules)")[0] == "False"


def test_the_router_process_serves_without_torch():
    lines = _run(_ROUTER_PROCESS)
    assert lines[:3] == ["models 200", "exit 0", "torch False"], lines
