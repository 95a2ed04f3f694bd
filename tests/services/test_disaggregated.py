"""Prompt engine -> completion engine, as separate processes with NIXL between them, against the
NORMAL engine as the reference: exact tokens, aborts at every stage, dead peers, queueing.

One module-scoped deployment (the model loads once per engine); tests that kill an engine start
their own. After every test both pools are whole: free == total, no lease, no pull.
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import time
import uuid

import msgspec
import pytest

from baton.ops.registry import RedisRegistry, RegistryConfig
from baton.protocol import AbortRequest, GenerateRequest, SamplingOptions, TokenDelta
from kv_transfer import protocol as kvproto
from kv_transfer.config import TransferConfig
from tests.cluster import EngineProcess, start_all, wait_for, wait_whole

pytestmark = pytest.mark.slow

PREFIX = "svc"
# A 64-token budget cuts the 300-token prompt into five prefill chunks.
PROMPT_ARGS = ["--num-blocks", "160", "--max-num-batched-tokens", "64", "--lease-ttl", "8"]
# The completion engine speculates (suffix drafts, baton/engine/speculation.py; drafting
# whatever its step times, so the test does not depend on them): every exactness test here
# also checks verified drafts against the plain NORMAL engine.
COMPLETION_ARGS = ["--num-blocks", "48", "--kv-timeout", "10", "--speculative", "suffix",
                   "--speculative-disable-by-batch-size", "64"]
NORMAL_ARGS = ["--num-blocks", "160"]
GREEDY = SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(redis_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("svc")
    url = redis_server.url
    engines = {
        "normal": EngineProcess("engine", "normal-0", logs, args=NORMAL_ARGS),
        "prompt": EngineProcess("prompt-engine", "prompt-0", logs, url, PREFIX, PROMPT_ARGS),
        "completion": EngineProcess("completion-engine", "completion-0", logs, url, PREFIX,
                                    COMPLETION_ARGS),
    }
    # The two prompt engines that one test kills and one binds to every interface start with
    # the module's, so that their model loads overlap; each of those tests waits for its own.
    spares = {
        "doomed": EngineProcess("prompt-engine", "prompt-doomed", logs, args=PROMPT_ARGS),
        "pod": EngineProcess("prompt-engine", "prompt-pod", logs, args=[
            *PROMPT_ARGS, "--host", "0.0.0.0", "--advertise-host", "127.0.0.1"]),
    }
    main = list(engines.values())
    engines.update(logs=logs, spares=spares)
    try:
        start_all(main)
        yield engines
    finally:
        for engine in [*main, *spares.values()]:
            engine.stop()


@pytest.fixture(autouse=True)
def pools_whole_after(cluster):
    yield
    wait_whole([cluster["normal"], cluster["prompt"], cluster["completion"]])


def _ids(n: int, seed: int = 0) -> list[int]:
    # Ordinary token ids (no specials): words of the vocabulary, deterministic.
    return [300 + (i * 7919 + seed * 104729) % 40000 for i in range(n)]


def _normal(cluster, ids: list[int], opts: SamplingOptions = GREEDY) -> list[int]:
    with cluster["normal"].client() as c:
        out = c.generate(ids, opts, timeout_s=120)
    assert out.finish_reason in ("stop", "length"), out.error
    return out.token_ids


def _prefill(prompt: EngineProcess, ids, req_id: str, opts=GREEDY) -> TokenDelta:
    with prompt.client() as c:
        first = c.generate(ids, opts, req_id=req_id, timeout_s=120)
    assert first.kv_handle and len(first.token_ids) == 1, first
    return first


def _decode(completion: EngineProcess, ids, first: TokenDelta, opts=GREEDY) -> TokenDelta:
    with completion.client() as c:
        return c.generate(ids, opts, req_id=first.req_id, timeout_s=120,
                          kv_handle=first.kv_handle, first_token_id=first.token_ids[0])


def _disaggregated(cluster, ids, opts=GREEDY) -> list[int]:
    first = _prefill(cluster["prompt"], ids, uuid.uuid4().hex, opts)
    rest = _decode(cluster["completion"], ids, first, opts)
    assert rest.finish_reason in ("stop", "length"), rest.error
    return first.token_ids + rest.token_ids


def _both_ways(cluster, ids, opts=GREEDY) -> tuple[list[int], list[int]]:
    """(disaggregated, normal) tokens of one request, the two sent at once: they run on
    different engines, so the pair takes about as long as the slower."""
    with cf.ThreadPoolExecutor(2) as pool:
        pd = pool.submit(_disaggregated, cluster, ids, opts)
        return pd.result(), _normal(cluster, ids, opts)


@pytest.mark.parametrize("num_tokens", [1, 15, 16, 17, 300])
def test_disaggregated_equals_normal(cluster, num_tokens):
    ids = _ids(num_tokens, seed=num_tokens)
    got, want = _both_ways(cluster, ids)
    assert got == want


def test_speculating_completion_engine_equals_normal(cluster):
    """A copy-heavy prompt (a passage, then its start again): the completion engine drafts
    from the prompt it received and keeps drafts; greedy and seeded output equal the plain
    NORMAL engine's."""
    passage = _ids(40, seed=3)
    ids = passage + passage + passage[:10]
    accepted = cluster["completion"].stats().extra["spec_accepted_tokens"]
    for opts in (SamplingOptions(max_tokens=24, temperature=0.0, logprobs=True),
                 SamplingOptions(max_tokens=24, temperature=0.8, seed=4, ignore_eos=True)):
        got, want = _both_ways(cluster, ids, opts)
        assert got == want
    assert cluster["completion"].stats().extra["spec_accepted_tokens"] > accepted + 10


@pytest.mark.parametrize("num_tokens", [17, 300])
def test_seeded_disaggregated_equals_normal(cluster, num_tokens):
    """A seeded draw is a function of (seed, choice, output position): the prompt engine's
    first token and the completion engine's rest equal one engine's whole run."""
    ids = _ids(num_tokens, seed=num_tokens + 7)
    opts = SamplingOptions(max_tokens=12, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True)
    got, want = _both_ways(cluster, ids, opts)
    assert got == want
    other = SamplingOptions(max_tokens=12, temperature=1.0, top_p=0.95, seed=11, ignore_eos=True,
                            sample_index=1)
    assert _normal(cluster, ids, other) != want  # the choice index is part of the draw


@pytest.mark.parametrize("opts", [
    SamplingOptions(max_tokens=14, temperature=0.0, ignore_eos=True, presence_penalty=0.8,
                    repetition_penalty=1.3, min_tokens=12),
    SamplingOptions(max_tokens=14, temperature=1.0, top_p=0.95, seed=5, ignore_eos=True,
                    frequency_penalty=0.5),
], ids=["greedy-penalised", "seeded"])
def test_a_migrated_request_continues_exactly(cluster, opts):
    """What the router sends when a completion engine fails after 5 tokens: the prompt and
    those outputs to a prompt engine (which prefills both and samples output 6), then on to a
    completion engine. Outputs 6.. equal one engine's undisturbed run: max_tokens, min_tokens,
    penalties and the seed's position count the 5 earlier outputs."""
    ids = _ids(37, seed=71)
    want = _normal(cluster, ids, opts)
    done = want[:5]
    with cluster["prompt"].client() as c:
        first = c.generate(ids, opts, req_id="mig-a~m1", timeout_s=120, output_token_ids=done)
    assert first.kv_handle and first.token_ids == want[5:6], first
    with cluster["completion"].client() as c:
        rest = c.generate(ids, opts, req_id="mig-a~m1", timeout_s=120, kv_handle=first.kv_handle,
                          first_token_id=first.token_ids[0], output_token_ids=done)
    assert rest.finish_reason == "length", rest.error
    assert done + first.token_ids + rest.token_ids == want


def test_16_concurrent_requests_equal_normal(cluster):
    prompts = [_ids(5 + 3 * i, seed=i) for i in range(16)]
    with cf.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda ids: _disaggregated(cluster, ids), prompts))
        want = list(pool.map(lambda ids: _normal(cluster, ids), prompts))
    assert got == want


def test_second_turn_pulls_only_what_the_first_left(cluster):
    """Prefix caching across the hand-off: turn 2 (turn 1's prompt + answer + a new message)
    skips turn 1's prompt blocks on the prompt engine, and its completion engine, which still
    holds turn 1's prompt and answer blocks, pulls only the rest; tokens equal NORMAL's."""
    opts = SamplingOptions(max_tokens=30, temperature=0.0, ignore_eos=True)
    turn1 = _ids(40, seed=501)
    answer = _disaggregated(cluster, turn1, opts)
    completion = cluster["completion"]
    before = completion.stats().extra
    turn2 = turn1 + answer + _ids(30, seed=502)  # 100 tokens: 7 blocks, 6 full
    first = _prefill(cluster["prompt"], turn2, uuid.uuid4().hex, opts)
    assert first.num_cached_tokens == 32  # turn 1's two full prompt blocks
    rest = _decode(completion, turn2, first, opts)
    after = completion.stats().extra
    # Turn 1 left 69 tokens of K/V there (the last answer token was never fed): 4 full blocks.
    assert after["kv_blocks_reused"] - before["kv_blocks_reused"] == 4
    assert after["kv_blocks_pulled"] - before["kv_blocks_pulled"] == 3
    assert first.token_ids + rest.token_ids == _normal(cluster, turn2, opts)


def test_prompts_sharing_cached_blocks_are_leased_apart(cluster):
    """Two prompts behind one prefix: the second's prefill hits the first's blocks while the
    first's lease still holds them; both are handed off, pulled and released on their own."""
    shared = _ids(48, seed=601)
    a, b = shared + _ids(10, seed=602), shared + _ids(20, seed=603)
    first_a = _prefill(cluster["prompt"], a, uuid.uuid4().hex)
    first_b = _prefill(cluster["prompt"], b, uuid.uuid4().hex)  # a's lease is still held
    assert first_b.num_cached_tokens == 48
    rest_b = _decode(cluster["completion"], b, first_b)
    rest_a = _decode(cluster["completion"], a, first_a)
    assert first_a.token_ids + rest_a.token_ids == _normal(cluster, a)
    assert first_b.token_ids + rest_b.token_ids == _normal(cluster, b)


def test_completion_engine_queues_when_out_of_blocks(cluster):
    """Three 250-token prompts need 16-17 blocks each; the completion engine has 47: the third
    waits (LATER) until one finishes, then is served, with the right tokens."""
    prompts = [_ids(250, seed=40 + i) for i in range(3)]
    opts = SamplingOptions(max_tokens=12, temperature=0.0, ignore_eos=True)
    with cf.ThreadPoolExecutor(3) as pool:
        firsts = list(pool.map(lambda i: _prefill(cluster["prompt"], prompts[i], f"q{i}", opts),
                               range(3)))
        rests = list(pool.map(lambda a: _decode(cluster["completion"], *a, opts),
                              zip(prompts, firsts, strict=True)))
    for ids, first, rest in zip(prompts, firsts, rests, strict=True):
        assert rest.finish_reason == "length", rest.error
        assert first.token_ids + rest.token_ids == _normal(cluster, ids, opts)


# --- aborts at every stage -------------------------------------------------------------------

def _collect(client, req_id: str, timeout_s: float = 60.0) -> TokenDelta:
    merged = TokenDelta(req_id)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = client.recv(deadline - time.monotonic())
        if isinstance(msg, TokenDelta) and msg.req_id == req_id:
            merged.token_ids += msg.token_ids
            merged.kv_handle = msg.kv_handle or merged.kv_handle
            if msg.finish_reason:
                merged.finish_reason, merged.error = msg.finish_reason, msg.error
                return merged
            if msg.kv_handle:
                return merged
    raise AssertionError(f"{req_id}: no final delta")


def test_abort_before_prefill(cluster):
    """No race: the request waits behind a prompt that cannot have its blocks yet (LATER while a
    lease holds part of the pool, S10) and `waiting` keeps arrival order, so it is aborted
    before any of its prefill."""
    prompt = cluster["prompt"]
    _prefill(prompt, _ids(40, seed=50), "ab0-lease")
    with prompt.client() as c:
        stats = c.stats()
        big_blocks = stats.num_free_blocks + 1  # one more than is free: LATER, not NEVER
        assert big_blocks < stats.num_total_blocks
        c.send(GenerateRequest("ab0-big", _ids(big_blocks * 16 - 8, seed=51), GREEDY))
        c.send(GenerateRequest("ab0", _ids(300), GREEDY))
        assert c.stats().num_waiting == 2  # same socket: both requests were taken first
        c.send(AbortRequest("ab0"))
        out = _collect(c, "ab0")
        assert out.finish_reason == "abort" and not out.kv_handle and not out.token_ids, out
        for req_id in ("ab0-big", "ab0-lease"):
            c.send(AbortRequest(req_id))
            assert _collect(c, req_id).finish_reason == "abort"


def test_abort_during_prefill(cluster):
    """The abort goes out once the engine has run a step for the prompt (its step count, read
    on the same socket), so it lands after the first of the prompt's 16 chunks and long before
    the last: the prefill stops with `abort`, never a KV handle."""
    num_chunks = 16
    with cluster["prompt"].client() as c:
        before = c.stats().num_steps
        c.send(GenerateRequest("ab1", _ids(64 * num_chunks, seed=1), GREEDY))
        # Each stats call waits for the step in progress: poll without sleeping.
        wait_for(lambda: c.stats().num_steps > before, timeout_s=60.0, poll_s=0.0)
        c.send(AbortRequest("ab1"))
        out = _collect(c, "ab1")
        assert out.finish_reason == "abort" and not out.kv_handle, out
        assert c.stats().num_steps - before < num_chunks


def test_abort_between_prefill_and_decode_drops_the_lease(cluster):
    first = _prefill(cluster["prompt"], _ids(40), "ab2")
    assert cluster["prompt"].stats().extra["kv_leases_active"] == 1
    with cluster["prompt"].client() as c:
        c.send(AbortRequest("ab2"))
        assert _collect(c, "ab2").finish_reason == "abort"
    # A completion engine that still gets the handle fails cleanly: the lease is gone.
    rest = _decode(cluster["completion"], _ids(40), first)
    assert rest.finish_reason == "kv_transfer_failed" and "no lease" in rest.error


@pytest.mark.parametrize("stage", ["pull", "decode"])
def test_abort_during_pull_or_decode(cluster, stage):
    """`pull`: the abort follows the request on the same socket, so it lands in admission or
    during the pull, before any decode step: no token, no committed pull. `decode`: it goes out
    once a decoded token has come back: the pull was committed and decoding stops early."""
    ids = _ids(120, seed=9)
    opts = SamplingOptions(max_tokens=200, temperature=0.0, ignore_eos=True)
    first = _prefill(cluster["prompt"], ids, f"ab3-{stage}", opts)
    completion = cluster["completion"]
    pulls_before = completion.stats().extra["kv_pulls_done"]
    with completion.client() as c:
        c.send(GenerateRequest(first.req_id, ids, opts, kv_handle=first.kv_handle,
                               first_token_id=first.token_ids[0]))
        decoded: list[int] = []
        if stage == "decode":
            while not decoded:  # the first delta that carries a decoded token
                msg = c.recv(60)
                assert isinstance(msg, TokenDelta) and not msg.finish_reason, msg
                decoded += msg.token_ids
        c.send(AbortRequest(first.req_id))
        out = _collect(c, first.req_id)
    assert out.finish_reason == "abort", out
    with cluster["prompt"].client() as c:  # as the router does: a lease never claimed ends now
        c.send(AbortRequest(first.req_id))
        c.stats()
    pulls_done = completion.stats().extra["kv_pulls_done"] - pulls_before
    if stage == "pull":
        assert not out.token_ids and pulls_done == 0, (out, pulls_done)
    else:
        assert pulls_done == 1 and 0 < len(decoded + out.token_ids) < 199


def test_bad_handle_is_refused(cluster):
    first = _prefill(cluster["prompt"], _ids(40, seed=3), "bad0")
    with cluster["completion"].client() as c:
        out = c.generate(_ids(41, seed=3), GREEDY, req_id="bad0", kv_handle=first.kv_handle,
                         first_token_id=first.token_ids[0])
        assert out.finish_reason == "bad_request" and "covers 40 tokens" in out.error
        out = c.generate(_ids(40, seed=3), GREEDY, req_id="bad1", kv_handle=b"\x93junk",
                         first_token_id=1)
        assert out.finish_reason == "bad_request"
        handle = kvproto.decode_handle(first.kv_handle)
        assert len(handle.block_keys) == 2
        forged = msgspec.structs.replace(handle, block_keys=[handle.block_keys[0] ^ 1,
                                                             handle.block_keys[1]])
        out = c.generate(_ids(40, seed=3), GREEDY, req_id="bad0", kv_handle=kvproto.encode(forged),
                         first_token_id=first.token_ids[0])
        assert out.finish_reason == "bad_request" and "block keys disagree" in out.error
        assert len(handle.checksums) == 3  # --kv-checksum all: one per block
        forged = msgspec.structs.replace(handle, checksums=handle.checksums[1:])
        out = c.generate(_ids(40, seed=3), GREEDY, req_id="bad0", kv_handle=kvproto.encode(forged),
                         first_token_id=first.token_ids[0])
        assert out.finish_reason == "bad_request" and "2 block checksums for 3" in out.error
    with cluster["prompt"].client() as c:
        c.send(AbortRequest("bad0"))
        c.stats()  # answered after the abort (one socket, in order): it was not lost on close


# --- dead peers --------------------------------------------------------------------------------

def test_prompt_engine_killed_before_the_pull(cluster):
    doomed = cluster["spares"]["doomed"]
    try:
        start_all([doomed])
        ids = _ids(60, seed=11)
        first = _prefill(doomed, ids, "dead0")
        doomed.kill()
        rest = _decode(cluster["completion"], ids, first)
        assert rest.finish_reason == "kv_transfer_failed", rest
        # The side channel's own deadline notices the dead peer, not the 10 s --kv-timeout.
        rpc_timeout_s = TransferConfig().rpc_timeout_s
        assert re.search(rf"\(peer_gone\): no (handshake|claim) answer from tcp://\S+ "
                         rf"within {rpc_timeout_s}s", rest.error), rest.error
    finally:
        doomed.kill()
    # The completion engine serves the next request as usual.
    ids = _ids(30, seed=12)
    got, want = _both_ways(cluster, ids)
    assert got == want


def test_completion_engine_killed_mid_decode(cluster, redis_server):
    prompt = cluster["prompt"]
    # A lease nobody claims expires (--lease-ttl 8); it is taken first, so that its TTL runs
    # while the doomed engine starts, and the test then waits for the expiry itself.
    expired_before = prompt.stats().extra.get("kv_leases_expired", 0)
    lone = _prefill(prompt, _ids(20, seed=14), "dead2")
    assert lone.kv_handle
    doomed = EngineProcess("completion-engine", "completion-doomed", cluster["logs"],
                           redis_server.url, PREFIX, COMPLETION_ARGS + ["--registry-ttl", "1.5"])
    registry = RedisRegistry(RegistryConfig(url=redis_server.url, prefix=PREFIX, ttl_s=1.5,
                                            heartbeat_s=0.5))
    try:
        start_all([doomed])
        assert "completion-doomed" in [r.engine_id for r in registry.list("completion")]
        ids = _ids(50, seed=13)
        opts = SamplingOptions(max_tokens=300, temperature=0.0, ignore_eos=True)
        first = _prefill(prompt, ids, "dead1", opts)
        with doomed.client() as c:
            c.send(GenerateRequest("dead1", ids, opts, kv_handle=first.kv_handle,
                                   first_token_id=first.token_ids[0]))
            c.recv(60)  # decoding has begun: the pull is done
            doomed.kill()
        # The lease of dead1 was released by its pull; the lone one expires.
        wait_for(lambda: prompt.stats().extra["kv_leases_active"] == 0, timeout_s=30,
                 poll_s=0.2)
        assert prompt.stats().extra["kv_leases_expired"] - expired_before == 1
        # The registry forgets the dead engine once its record's TTL has run out.
        wait_for(lambda: "completion-doomed" not in [
            r.engine_id for r in registry.list("completion")], timeout_s=15, poll_s=0.2)
    finally:
        doomed.kill()
        registry.close()


def test_registry_shows_live_engines_and_a_restarted_one(cluster, redis_server):
    registry = RedisRegistry(RegistryConfig(url=redis_server.url, prefix=PREFIX))
    try:
        records = {r.engine_id: r for role in ("prompt", "completion")
                   for r in registry.list(role)}
        assert {"prompt-0", "completion-0"} <= set(records)
        prompt = records["prompt-0"]
        assert prompt.side_channel.startswith("tcp://127.0.0.1:")
        assert prompt.num_total_blocks == 159 and prompt.block_size == 16
        assert prompt.model_fingerprint == records["completion-0"].model_fingerprint
        again = EngineProcess("completion-engine", "completion-doomed", cluster["logs"],
                              redis_server.url, PREFIX, COMPLETION_ARGS)
        try:
            start_all([again])
            assert "completion-doomed" in [r.engine_id for r in registry.list("completion")]
        finally:
            again.stop()
        # SIGTERM deregisters at once.
        assert "completion-doomed" not in [r.engine_id for r in registry.list("completion")]
    finally:
        registry.close()


def test_garbage_on_the_engine_socket_is_dropped(cluster):
    with cluster["prompt"].client() as c:
        c.sock.send(b"\x93not-a-message")
        c.sock.send_multipart([b"two", b"frames"])
        stats = c.stats()
    assert stats.extra["num_bad_messages"] >= 2 and stats.healthy
    with cluster["normal"].client() as c:
        out = c.generate([0] * 3 + [10**9], GREEDY)  # a token id past the vocabulary
    assert out.finish_reason == "error" and "out of range" in out.error
    ids = _ids(12, seed=21)
    got, want = _both_ways(cluster, ids)
    assert got == want


def test_wildcard_bind_advertises_a_dialable_address(cluster):
    """As in Kubernetes: bound to every interface, the engine names its advertised address in
    the registry record and in KV handles, and a completion engine can pull from it."""
    from kv_transfer.protocol import decode_handle

    pod = cluster["spares"]["pod"]
    try:
        start_all([pod])
        ids = _ids(24, seed=31)
        first = _prefill(pod, ids, "pod0")
        assert decode_handle(first.kv_handle).side_channel.startswith("tcp://127.0.0.1:")
        rest = _decode(cluster["completion"], ids, first)
        assert first.token_ids + rest.token_ids == _normal(cluster, ids)
        wait_whole([pod])
    finally:
        pod.stop()
