"""Authenticated internal wires (kv_transfer/auth.py, baton/ops/cluster_keys.py): a real prompt
engine process serving CURVE on its request socket and its KV side channel. A peer without the
cluster's client key (none at all, a key of its own, or the wrong server key) gets no answer
from either socket, and each refusal is counted on the engine's /metrics; the cluster's key gets
answers. Plus the key files' rules, the flags, and `baton up`'s generated keys.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import urllib.request

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from baton.ops.cluster_keys import resolve_keys
from baton.ops.ports import free_port
from baton.protocol import EngineStats, StatsRequest, decode_to_router, encode
from baton_cli.launcher import LaunchConfig, Launcher
from kv_transfer import protocol as kv_proto
from kv_transfer.auth import ENV_KEY_DIR, ClusterKeys, generate
from router.config import RouterConfig
from tests.cluster import KEYS, EngineProcess, start_all, wait_for

pytestmark = pytest.mark.slow

NO_ANSWER_S = 1.5  # a CURVE handshake on loopback takes about a millisecond


@pytest.fixture(scope="module")
def prompt_engine(tmp_path_factory):
    logs = tmp_path_factory.mktemp("auth")
    metrics_port, side_port = free_port(), free_port()
    engine = EngineProcess("prompt-engine", "prompt-auth", logs, args=[
        "--num-blocks", "32", "--metrics-port", str(metrics_port),
        "--side-channel-port", str(side_port)])
    engine.metrics_port, engine.side_channel = metrics_port, f"tcp://127.0.0.1:{side_port}"
    try:
        start_all([engine])
        yield engine
    finally:
        engine.stop()


def refused(engine: EngineProcess, endpoint: str) -> float:
    url = f"http://127.0.0.1:{engine.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5.0) as resp:
        families = text_string_to_metric_families(resp.read().decode())
        return sum(s.value for f in families for s in f.samples
                   if s.name == "baton_auth_refused_total" and s.labels["endpoint"] == endpoint)


def dealer(address: str, kind: str) -> zmq.Socket:
    """A DEALER dialing `address` as: the cluster's client, a stranger (no CURVE), a client
    with a key pair of its own, or one that pins a wrong server key."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == "cluster":
        KEYS.apply_client(sock)
    elif kind == "own_key":
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = KEYS.server_public
    elif kind == "wrong_server":
        sock.curve_publickey, sock.curve_secretkey = KEYS.client_public, KEYS.client_secret
        sock.curve_serverkey = zmq.curve_keypair()[0]
    else:
        assert kind == "none"
    sock.connect(address)
    return sock


def ask(address: str, kind: str, payload: bytes) -> bytes | None:
    """The first reply to `payload`, or None when none comes within NO_ANSWER_S."""
    sock = dealer(address, kind)
    try:
        sock.send(payload)
        return sock.recv() if sock.poll(int(NO_ANSWER_S * 1000)) else None
    finally:
        sock.close(linger=0)


STRANGERS = ["none", "own_key", "wrong_server"]


@pytest.mark.parametrize("kind", STRANGERS)
def test_engine_socket_answers_only_the_cluster(prompt_engine, kind):
    before = refused(prompt_engine, "engine")
    assert ask(prompt_engine.address, kind, encode(StatsRequest(7))) is None
    # The server counts refusals a client without the server's key cannot even make: a
    # wrong-server-key client fails inside its own handshake and the engine sees a bad HELLO.
    wait_for(lambda: refused(prompt_engine, "engine") > before, timeout_s=5.0, poll_s=0.1)
    reply = decode_to_router(ask(prompt_engine.address, "cluster", encode(StatsRequest(8))))
    assert isinstance(reply, EngineStats) and reply.nonce == 8


@pytest.mark.parametrize("kind", STRANGERS)
def test_kv_side_channel_answers_only_the_cluster(prompt_engine, kind):
    before = refused(prompt_engine, "kv_side_channel")
    hello = kv_proto.encode(kv_proto.Handshake(3))
    assert ask(prompt_engine.side_channel, kind, hello) is None
    wait_for(lambda: refused(prompt_engine, "kv_side_channel") > before, timeout_s=5.0,
             poll_s=0.1)
    reply = kv_proto.decode_to_importer(ask(prompt_engine.side_channel, "cluster", hello))
    assert isinstance(reply, kv_proto.HandshakeReply) and reply.seq == 3


def test_probe_needs_the_keys(prompt_engine):
    env = {k: v for k, v in os.environ.items() if k != ENV_KEY_DIR}
    base = [sys.executable, "-m", "baton_cli", "probe", "--address", prompt_engine.address,
            "--timeout", "1"]
    nokeys = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
    assert nokeys.returncode == 2 and "--cluster-key-dir" in nokeys.stderr
    insecure = subprocess.run([*base, "--insecure"], env=env, capture_output=True, text=True,
                              timeout=60)
    assert insecure.returncode == 1 and "no answer" in insecure.stderr
    assert "NOT authenticated" in insecure.stderr  # the loud warning
    ok = subprocess.run([*base, "--cluster-key-dir", KEYS.key_dir], env=env,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_generated_keys_are_private_and_load(tmp_path):
    root = generate(tmp_path / "keys")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for path in root.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    keys = ClusterKeys.load(root)
    assert keys.can_serve and keys.can_dial and keys.server_public != keys.client_public
    assert keys.server_secret.decode() not in repr(keys)


def test_key_dir_rules(tmp_path):
    root = generate(tmp_path / "keys")
    (root / "server.key_secret").chmod(0o644)
    with pytest.raises(ValueError, match="readable by every user"):
        ClusterKeys.load(root)
    (root / "server.key_secret").unlink()  # a router's Secret: no server secret
    router_keys = ClusterKeys.load(root)
    assert router_keys.can_dial and not router_keys.can_serve
    with pytest.raises(ValueError, match="cannot serve"):
        router_keys.apply_server(zmq.Context.instance().socket(zmq.ROUTER), "engine")
    (root / "client.key").unlink()
    with pytest.raises(ValueError, match="lacks client.key"):
        ClusterKeys.load(root)
    with pytest.raises(ValueError, match="does not exist"):
        ClusterKeys.load(tmp_path / "nowhere")


def test_no_keys_no_start(monkeypatch):
    monkeypatch.delenv(ENV_KEY_DIR)
    with pytest.raises(ValueError, match="no cluster keys"):
        RouterConfig()
    with pytest.raises(ValueError, match="no cluster keys"):
        resolve_keys("", False, "baton engine")
    assert RouterConfig(insecure=True).cluster_keys is None
    assert resolve_keys("", True, "baton engine") is None


def test_baton_up_generates_a_private_key_dir(monkeypatch):
    monkeypatch.delenv(ENV_KEY_DIR)
    launcher = Launcher(LaunchConfig())
    assert launcher._setup_keys()[0] == "--cluster-key-dir"
    key_dir = launcher._own_key_dir
    assert stat.S_IMODE(os.stat(key_dir).st_mode) == 0o700
    assert launcher.keys.can_serve and launcher.keys.can_dial
    launcher.stop()
    assert not os.path.exists(key_dir)
    insecure = Launcher(LaunchConfig(insecure=True))
    assert insecure._setup_keys() == ["--insecure"] and insecure.keys is None
    with pytest.raises(ValueError, match="contradict"):
        LaunchConfig(insecure=True, cluster_key_dir=key_dir)
    with pytest.raises(ValueError, match="not after --"):
        LaunchConfig(engine_args=["--insecure"])
