"""The local disk tier (docs/scheduler.md P10) in the engine: blocks the pool evicts come back from
disk token for token (greedy text == cold run == pool hit), a corrupted or foreign file is a
counted miss and never wrong output, a restart finds the files, and a disk that cannot be
used degrades to recompute with a warning."""

from __future__ import annotations

import logging

import msgspec
import numpy as np
import pytest
from model.reference import baton_model, prompt_of_length

from baton.engine import AllocStatus, LLMEngine, kv_disk_store
from baton.engine.block_keys import compute_block_keys
from baton.engine.kv_disk_store import MAGIC
from baton.sampling.params import SamplingParams
from kv_transfer.protocol import Fingerprint
from tests.threads import engine_config

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
pytestmark = pytest.mark.slow
# Small blocks keep the prompts (and the test) short: 11 usable blocks of 4 tokens.
BS, NUM_BLOCKS = 4, 12
A = prompt_of_length(18)  # 4 full blocks before its last token, keyed when it is done
B = prompt_of_length(80)[40:78]  # 10 blocks: evicts 3 of A's 4 (deepest first, P2)
NUM_A_BLOCKS = (len(A) - 1) // BS


def make_engine(disk_dir, **overrides) -> LLMEngine:
    return LLMEngine(engine_config(**{"num_blocks": NUM_BLOCKS, "block_size": BS,
                                      "kv_disk_dir": str(disk_dir), **overrides}),
                     loaded=baton_model())


@pytest.fixture(scope="module")
def cold_a() -> list[int]:
    engine = LLMEngine(engine_config(num_blocks=NUM_BLOCKS, block_size=BS,
                                     enable_prefix_caching=False), loaded=baton_model())
    return engine.generate(A, GREEDY)[0].token_ids


def evict_a(engine: LLMEngine) -> None:
    """A's blocks leave the pool for the disk (its first block stays in the pool)."""
    engine.generate(A, GREEDY)
    engine.generate(B, GREEDY)
    engine.disk.flush()


def segments(disk_dir) -> list:
    return sorted(disk_dir.glob("*.kvd"))


def test_p10_blocks_from_disk_give_the_cold_text(tmp_path, cold_a) -> None:
    engine = make_engine(tmp_path)
    evict_a(engine)
    assert engine.scheduler.num_held_prefix_blocks(
        compute_block_keys(A[:NUM_A_BLOCKS * BS], BS, engine.prefix_cache_seed)) == 1
    from_disk = engine.generate(A, GREEDY)[0]
    assert from_disk.token_ids == cold_a
    assert from_disk.num_cached_tokens == NUM_A_BLOCKS * BS  # the pool's block and the disk's
    stats = engine.tier_stats()
    assert stats["kv_tier_loaded_blocks_disk"] == NUM_A_BLOCKS - 1
    assert stats["kv_tier_hit_tokens_disk"] == (NUM_A_BLOCKS - 1) * BS
    assert stats["kv_integrity_failures_disk"] == 0
    pool_hit = engine.generate(A, GREEDY)[0]  # now all in the pool
    assert pool_hit.token_ids == cold_a and pool_hit.num_cached_tokens == NUM_A_BLOCKS * BS
    assert engine.tier_stats()["kv_tier_loaded_blocks_disk"] == NUM_A_BLOCKS - 1
    assert engine.num_free_blocks() == engine.num_total_blocks()
    engine.scheduler.check_invariants()
    # /reset_prefix_cache?pool_only=true keeps the disk; the plain reset clears it.
    assert engine.reset_prefix_cache(pool_only=True) and engine.disk.store.index
    assert engine.reset_prefix_cache() and not engine.disk.store.index
    engine.disk.flush()
    assert not segments(tmp_path) and engine.tier_stats()["kv_tier_bytes_disk"] == 0
    engine.close()


def test_p10_flipped_bytes_are_a_counted_miss(tmp_path, cold_a) -> None:
    engine = make_engine(tmp_path)
    evict_a(engine)
    store = engine.disk.store
    header = len(store.header)
    for path in segments(tmp_path):  # one byte of every block's K/V, in place
        data = bytearray(path.read_bytes())
        for offset in range(header, len(data) - store.record_bytes + 1, store.record_bytes):
            data[offset + store.record_bytes - 100] ^= 0xFF
        path.write_bytes(bytes(data))
    out = engine.generate(A, GREEDY)[0]
    assert out.token_ids == cold_a
    assert out.num_cached_tokens == BS  # the pool's block only: the disk's were refused
    stats = engine.tier_stats()
    assert stats["kv_integrity_failures_disk"] == 1  # the run stops at the first refusal
    assert stats["kv_tier_loaded_blocks_disk"] == 0 and stats["kv_tier_missed_blocks_disk"] > 0
    engine.close()


def test_p10_restart_serves_from_disk_and_another_producer_is_refused(tmp_path, cold_a,
                                                                     caplog) -> None:
    first = make_engine(tmp_path)
    first.generate(A, GREEDY)
    first.close()  # the pool's cached blocks go to disk too
    restarted = make_engine(tmp_path)
    out = restarted.generate(A, GREEDY)[0]
    assert out.token_ids == cold_a and out.num_cached_tokens == NUM_A_BLOCKS * BS
    assert restarted.tier_stats()["kv_tier_loaded_blocks_disk"] == NUM_A_BLOCKS
    restarted.close()
    # Other weights under the same name (same keys, other bytes): every file is refused.
    for path in segments(tmp_path):
        data = path.read_bytes()
        size = int.from_bytes(data[len(MAGIC):len(MAGIC) + 4], "little")
        body = data[len(MAGIC) + 4:len(MAGIC) + 4 + size]
        theirs = msgspec.msgpack.decode(body, type=Fingerprint)
        other = msgspec.structs.replace(theirs, weights="f" * len(theirs.weights))
        new_body = msgspec.msgpack.encode(other)
        assert len(new_body) == size
        path.write_bytes(data[:len(MAGIC) + 4] + new_body + data[len(MAGIC) + 4 + size:])
    with caplog.at_level(logging.WARNING, logger="baton.engine.kv_disk_store"):
        foreign = make_engine(tmp_path)
    assert "another producer" in caplog.text
    out = foreign.generate(A, GREEDY)[0]
    assert out.token_ids == cold_a and out.num_cached_tokens == 0
    assert foreign.tier_stats()["kv_integrity_failures_disk"] >= 1
    foreign.close()


def test_p10_completion_engine_loads_what_it_need_not_pull(tmp_path) -> None:
    normal = make_engine(tmp_path)
    normal.generate(A, GREEDY)
    normal.close()
    completion = make_engine(tmp_path, engine_type="completion")
    keys = compute_block_keys(A, BS, completion.prefix_cache_seed)
    alloc = completion.add_prompted_request("c", A, [], GREEDY, 7, 0.0, block_keys=keys)
    assert alloc.status == AllocStatus.OK and alloc.num_cached_blocks == NUM_A_BLOCKS
    completion.free_prompted("c")
    completion.close()


def test_p10_unusable_dir_or_failing_disk_degrades_with_a_warning(tmp_path, cold_a, caplog,
                                                                  monkeypatch) -> None:
    (tmp_path / "file").write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="baton.engine.kv_disk"):
        engine = make_engine(tmp_path / "file" / "kv")
    assert engine.disk is None and "KV disk tier off" in caplog.text
    assert engine.generate(A, GREEDY)[0].token_ids == cold_a
    # A budget of two blocks: older files go first, the files stay within it.
    small = make_engine(tmp_path / "small", kv_disk_bytes=2 * 190_000)
    evict_a(small)
    assert 0 < small.disk.store.num_bytes <= small.disk.store.budget_bytes
    assert len(small.disk.store.index) < small.tier_stats()["kv_tier_written_blocks_disk"]
    small.close()

    def full_disk(fd, data):  # a fake: this host's disk does not fill on demand
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_disk_store.os, "write", full_disk)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="baton.engine.kv_disk"):
        failing = make_engine(tmp_path / "full")
        evict_a(failing)
    assert "writing" in caplog.text and failing.tier_stats()["kv_tier_errors_disk"] >= 1
    out = failing.generate(A, GREEDY)[0]
    assert out.token_ids == cold_a and out.num_cached_tokens == BS
    monkeypatch.undo()
    failing.close()
    assert np.all([p.stat().st_size >= 0 for p in segments(tmp_path / "full")])
