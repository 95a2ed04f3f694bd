"""The shared tier's flags (README: KV tiers): every engine command takes --kv-shared-tier URL,
`baton up --kv-shared-tier local:SIZE` starts a closed Redis with that maxmemory and LRU
eviction and hands its URL and password file to every engine, and a bad or misplaced value is
refused by name."""

from __future__ import annotations

import pytest

from baton.ops.registry import connect
from baton_cli.engine_main import shared_store
from baton_cli.launcher import LaunchConfig, Launcher
from baton_cli.main import build_parser


@pytest.mark.parametrize("command", ["engine", "prompt-engine", "completion-engine"])
def test_every_engine_command_takes_the_shared_tier(command: str, capsys) -> None:
    args = build_parser().parse_args([command, "--kv-shared-tier", "redis://baton@kv:6379/0",
                                      "--kv-shared-password-file", "/run/kv.password"])
    assert args.kv_shared_tier == "redis://baton@kv:6379/0"
    assert args.kv_shared_password_file == "/run/kv.password"
    assert shared_store(build_parser().parse_args([command])) is None
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--kv-shared-tier", "local:1G"])
    assert "is for `baton up`" in capsys.readouterr().err


def test_baton_up_starts_the_store_and_hands_it_to_every_engine() -> None:
    launcher = Launcher(LaunchConfig(kv_shared_tier="local:8M"))
    try:
        launcher.shared_args = launcher._start_shared_tier()
        server = launcher.kv_redis
        raw = connect(server.url, server.password_file)
        assert raw.config_get("maxmemory")["maxmemory"] == str(8 << 20)
        assert raw.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        raw.close()
        for command, engine_id in (("prompt-engine", "prompt-0"),
                                   ("completion-engine", "completion-0"), ("engine", "n-0")):
            launcher._start_engine(command, engine_id, 1, "")
        for child in launcher.children:
            argv = child.argv
            assert argv[argv.index("--kv-shared-tier") + 1] == server.url
            assert argv[argv.index("--kv-shared-password-file") + 1] == server.password_file
    finally:
        launcher.stop()
    external = Launcher(LaunchConfig(kv_shared_tier="redis://baton@kv:6379/0",
                                     kv_shared_password_file="/run/kv.password"))
    assert external._start_shared_tier() == ["--kv-shared-tier", "redis://baton@kv:6379/0",
                                             "--kv-shared-password-file", "/run/kv.password"]
    assert external.kv_redis is None
    assert LaunchConfig(kv_shared_tier="local").kv_shared_local_bytes == 1 << 30


@pytest.mark.parametrize(("config", "message"), [
    ({"engine_args": ["--kv-shared-tier", "redis://x:1/0"]}, "give --kv-shared-tier to `baton up`"),
    ({"kv_shared_tier": "memcached://x"}, "redis://, rediss:// or unix://"),
    ({"kv_shared_tier": "local:lots"}, "not a size"),
    ({"kv_shared_tier": "local", "kv_shared_password_file": "/p"}, "makes its own password"),
    ({"kv_shared_password_file": "/p"}, "is for --kv-shared-tier URL"),
])
def test_bad_shared_tier_values_are_refused_by_name(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchConfig(**config)


@pytest.mark.slow  # a multi-process deployment
def test_baton_up_with_a_local_store_publishes_from_its_engines() -> None:
    """`baton up --kv-shared-tier local:16M` over mock engines (the real engine loop, scheduler
    and tiers, only the model replaced): the store starts, every engine logs its shared tier,
    and the prompt blocks an engine computes reach the store (its metrics count them)."""
    import re
    import time

    import httpx
    from openai import OpenAI

    from baton.workload.words import WORDS
    from tests.sim.test_mock_engines import _start

    up = _start(["--normal-engines", "2", "--kv-shared-tier", "local:16M"],
                engine_flags=["--num-blocks", "16"])
    try:
        banner = up.banner
        assert "KV shared tier redis://baton@127.0.0.1:" in banner
        client = OpenAI(base_url=f"{up.base_url}/v1", api_key="none", max_retries=0, timeout=30)
        model = client.models.list().data[0].id
        content = " ".join(WORDS[j % len(WORDS)] for j in range(120))
        client.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                       messages=[{"role": "user", "content": content}])
        metrics = re.findall(r"metrics (http://\S+)", banner)
        assert len(metrics) == 2, banner
        deadline = time.monotonic() + 20
        while True:
            text = "".join(httpx.get(url, timeout=5).text for url in metrics)
            written = [float(v) for v in re.findall(
                r'baton_kv_tier_written_blocks_total\{[^}]*tier="shared"[^}]*\} (\S+)', text)]
            if sum(written) > 0:
                break
            assert time.monotonic() < deadline, text[-2000:]
            time.sleep(0.3)
        assert sum("shared redis://" in line for line in up.stderr.lines) == 2
    finally:
        up.stop()
