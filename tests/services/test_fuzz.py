"""Untrusted bytes at every internal endpoint (issue 32): random, truncated, bit-flipped and
multi-frame messages, sent with the cluster's CURVE keys so that they reach the decoders.

  engine socket     a real prompt engine process (its ROUTER socket, baton/protocol.py)
  KV side channel   the same process's exporter (kv_transfer/protocol.py)
  router side       the router's EngineClient (router/engine_client.py) with a KvIndex, fed
                    by a socket standing in for an engine, in this process
  KV importer       tests/kv_transfer/test_kv_fuzz.py (a stand-in exporter answers it)

Each endpoint must not crash (the process and its loops live), not hang (a valid request is
answered after every burst), and not leak (the engine's pool and leases drain back to whole;
the router side keeps no request queue and no index entry the garbage made). The bursts run
for BATON_FUZZ_SECONDS each (default 3: CI); tests/stress/test_fuzz_long.py runs them long.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from baton.ops.ports import free_port
from baton.protocol import (
    AbortRequest,
    ControlReply,
    EngineOutputs,
    EngineStats,
    GenerateRequest,
    KvEvents,
    ResetPrefixCache,
    SamplingOptions,
    StatsRequest,
    SubscribeKvEvents,
    TokenDelta,
    decode_to_router,
    encode,
    pack_keys,
)
from kv_transfer import protocol as kv_proto
from kv_transfer.auth import stop_authenticator
from router.engine_client import EngineClient
from router.kv_index import KvIndex
from tests.cluster import KEYS, EngineProcess, start_all, wait_for

pytestmark = pytest.mark.slow

FUZZ_SECONDS = float(os.environ.get("BATON_FUZZ_SECONDS", "3"))
ANSWER_TIMEOUT_S = 10.0  # a valid request after a burst: far above a step on this model
LEASE_TTL_S = 2.0  # fuzzed prompts that decode as valid hold a lease this long


def mutations(rng: random.Random, valid: list[bytes]) -> list[bytes]:
    """One burst's worth of hostile frames derived from `valid` messages."""
    base = rng.choice(valid)
    frames = [
        rng.randbytes(rng.randrange(0, 2048)),  # noise
        base[:rng.randrange(0, max(1, len(base)))],  # truncated
        bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 0.05 else b for b in base),  # flipped
        base + rng.randbytes(rng.randrange(1, 64)),  # trailing bytes
        msgspec.msgpack.encode(_random_value(rng, 3)),  # well-formed msgpack, wrong shape
        b"",
    ]
    return frames


def _random_value(rng: random.Random, depth: int):
    choices = [lambda: rng.randrange(-2**63, 2**63), lambda: rng.random() * 1e300,
               lambda: rng.randbytes(rng.randrange(16)), lambda: "x" * rng.randrange(600),
               lambda: None, lambda: True]
    if depth > 0:
        choices += [lambda: [_random_value(rng, depth - 1) for _ in range(rng.randrange(6))],
                    lambda: {str(i): _random_value(rng, depth - 1) for i in range(rng.randrange(4))}]
    return rng.choice(choices)()


def _dealer(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    KEYS.apply_client(sock)
    sock.connect(address)
    return sock


def _drain(sock: zmq.Socket) -> int:
    num = 0
    while sock.poll(0):
        sock.recv_multipart()
        num += 1
    return num


@pytest.fixture(scope="module")
def prompt_engine(tmp_path_factory):
    logs = tmp_path_factory.mktemp("fuzz")
    side_port = free_port()
    engine = EngineProcess("prompt-engine", "prompt-fuzz", logs, args=[
        "--num-blocks", "64", "--max-model-len", "512", "--side-channel-port", str(side_port),
        "--lease-ttl", str(LEASE_TTL_S)])
    engine.side_channel = f"tcp://127.0.0.1:{side_port}"
    try:
        start_all([engine])
        yield engine
    finally:
        engine.stop()


def _stats(sock: zmq.Socket, nonce: int) -> EngineStats:
    """A stats request answered within ANSWER_TIMEOUT_S (replies to the fuzz are skipped)."""
    sock.send(encode(StatsRequest(nonce)))
    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and sock.poll(int(left * 1000)), "the engine hangs after a burst"
        msg = decode_to_router(sock.recv())
        if isinstance(msg, EngineStats) and msg.nonce == nonce:
            return msg


def fuzz_engine_socket(engine: EngineProcess, seconds: float, seed: int) -> int:
    """Bursts at the engine's request socket for `seconds`; returns the frames sent."""
    rng = random.Random(seed)
    greedy = SamplingOptions(max_tokens=2, temperature=0.0)
    valid = [encode(StatsRequest(5)), encode(AbortRequest("nobody")),
             encode(GenerateRequest("fz", [1, 2, 3, 4], greedy)),
             encode(GenerateRequest("fz2", [5] * 40, SamplingOptions(max_tokens=1, n=3))),
             encode(SubscribeKvEvents(3)), encode(ResetPrefixCache(4))]
    # Decodable but hostile: bounds the decoder itself enforces (n, id length, choices).
    hostile = [encode(GenerateRequest("n", [1], SamplingOptions(n=2**40))),
               encode(GenerateRequest("x" * 100_000, [1], greedy)),
               encode(GenerateRequest("c", [1], greedy, choice_indices=list(range(10_000)))),
               encode(GenerateRequest("s", [1], greedy, cache_salt="s" * 10_000)),
               encode(GenerateRequest("v", [2**31 - 1, -5], greedy)),
               encode(GenerateRequest("m", [1], SamplingOptions(max_tokens=-1)))]
    ctx = zmq.Context()
    sock = _dealer(ctx, engine.address)
    num_sent, nonce, deadline = 0, 100, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for frame in mutations(rng, valid) + [rng.choice(hostile)]:
                sock.send(frame)
                num_sent += 1
            sock.send_multipart([b"a", b"b", b"c"][:rng.randrange(2, 4)])  # wrong frame count
            num_sent += 1
            _drain(sock)
            nonce += 1
            _stats(sock, nonce)
            assert engine.proc.poll() is None, engine.tail()
    finally:
        sock.close(linger=0)
        ctx.term()
    return num_sent


def test_engine_socket_survives_fuzz(prompt_engine):
    before = prompt_engine.stats()
    num_sent = fuzz_engine_socket(prompt_engine, FUZZ_SECONDS, seed=1)
    after = prompt_engine.stats()
    assert after.extra["num_bad_messages"] > before.extra["num_bad_messages"]
    assert num_sent > 0 and prompt_engine.proc.poll() is None
    # No leak: whatever decoded as a prompt finished, and its lease (never claimed) expired.
    wait_for(lambda: _is_idle(prompt_engine.stats()), timeout_s=LEASE_TTL_S + 20, poll_s=0.2)


def _is_idle(stats: EngineStats) -> bool:
    return (stats.num_running == 0 and stats.num_waiting == 0
            and stats.num_free_blocks == stats.num_total_blocks
            and stats.extra.get("kv_leases_active", 0) == 0)


def fuzz_side_channel(engine: EngineProcess, seconds: float, seed: int) -> int:
    rng = random.Random(seed)
    valid = [kv_proto.encode(kv_proto.Handshake(1)),
             kv_proto.encode(kv_proto.Claim(2, "req", "inst", "agent", [1, 2, 3],
                                            credential=b"\0" * 16))]
    ctx = zmq.Context()
    sock = _dealer(ctx, engine.side_channel)
    num_sent, seq, deadline = 0, 1000, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for frame in mutations(rng, valid):
                sock.send(frame)
                num_sent += 1
            _drain(sock)
            seq += 1
            sock.send(kv_proto.encode(kv_proto.Handshake(seq)))
            t_end = time.monotonic() + ANSWER_TIMEOUT_S
            while True:
                left = t_end - time.monotonic()
                assert left > 0 and sock.poll(int(left * 1000)), "the side channel hangs"
                reply = kv_proto.decode_to_importer(sock.recv())
                if isinstance(reply, kv_proto.HandshakeReply) and reply.seq == seq:
                    break
            assert engine.proc.poll() is None, engine.tail()
    finally:
        sock.close(linger=0)
        ctx.term()
    return num_sent


def test_kv_side_channel_survives_fuzz(prompt_engine):
    assert fuzz_side_channel(prompt_engine, FUZZ_SECONDS, seed=2) > 0
    stats = prompt_engine.stats()
    assert stats.extra.get("kv_leases_active", 0) == 0  # no claim got through
    assert prompt_engine.proc.poll() is None


async def fuzz_router_side(seconds: float, seed: int) -> int:
    """An EngineClient (with a KvIndex) dialing a socket that stands in for an engine and
    answers it with hostile frames; it must keep serving a valid reply after each burst."""
    rng = random.Random(seed)
    address = f"tcp://127.0.0.1:{free_port()}"
    server_ctx = zmq.Context()
    server = server_ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    KEYS.apply_server(server, "fuzz_engine")
    server.bind(address)
    valid = [encode(EngineOutputs([TokenDelta("r1", [1, 2], [0.0, -1.0], index=3)])),
             encode(KvEvents("inst", 0, True, pack_keys([1, 2, 3]), b"", 1, 16, 7, 8)),
             encode(KvEvents("inst", 1, False, pack_keys([4]), pack_keys([1]))),
             encode(ControlReply(99, True)),
             encode(EngineStats("e", "prompt"))]
    hostile = [encode(KvEvents("inst", 0, True, b"\1" * 8 * 100, b"", 2, 16, 7, 4)),
               encode(KvEvents("other", 9, False, b"\1" * 7)),
               encode(KvEvents("", 0, True, b"", b"", 3, 0, 2**64 - 1, 1))]
    kv_index = KvIndex()
    ctx = zmq.asyncio.Context()
    client = EngineClient(ctx, address, kv_index, KEYS)
    num_sent = 0
    try:
        await client.subscribe_kv_events()  # the server learns the client's identity
        identity = (await asyncio.to_thread(server.recv_multipart))[0]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for frame in mutations(rng, valid) + [rng.choice(hostile)]:
                server.send_multipart([identity, frame])
                num_sent += 1
            reset = asyncio.create_task(client.reset_prefix_cache(ANSWER_TIMEOUT_S))
            request = await asyncio.to_thread(_next_reset, server)
            server.send_multipart([identity, encode(ControlReply(request.nonce, True))])
            assert (await reset).ok
            assert not any(t.done() for t in client._tasks), "a receive loop died"
            entry = kv_index.get(address)
            assert entry is None or len(entry.keys) <= entry.num_total_blocks
        assert client.num_open == 0
        assert kv_index.num_resyncs > 0  # the hostile KV events reached the index, refused
    finally:
        await client.close()
        ctx.term()
        server.close(linger=0)
        stop_authenticator(server_ctx)
        server_ctx.term()
    return num_sent


def _next_reset(server: zmq.Socket) -> ResetPrefixCache:
    from baton.protocol import decode_to_engine

    deadline = time.monotonic() + ANSWER_TIMEOUT_S
    while True:  # the client may also have asked for KV events again
        left = deadline - time.monotonic()
        assert left > 0 and server.poll(int(left * 1000)), "the client sent nothing"
        msg = decode_to_engine(server.recv_multipart()[1])
        if isinstance(msg, ResetPrefixCache):
            return msg


def test_router_side_survives_fuzz():
    assert asyncio.run(fuzz_router_side(FUZZ_SECONDS, seed=3)) > 0
