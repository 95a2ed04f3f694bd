"""A prompt-engine stand-in for tests: a KVExporter over a numpy pool in its own process.

The parent drives it through a Pipe. Blocks are filled with a pattern that depends on
(seed, position in the request) only, so the importer can check bytes without a copy.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from typing import Any

import numpy as np

TEST_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}


def pattern(seed: int, position: int, block_bytes: int) -> np.ndarray:
    words = np.arange(block_bytes // 8, dtype=np.uint64)
    words += np.uint64(((seed & 0xFFFFFF) << 40) | ((position & 0xFFFF) << 24))
    return words.view(np.uint8)


def fingerprint(**overrides: Any):
    from kv_transfer import Fingerprint

    fields = dict(model="test-model", dtype="float32", num_layers=2, num_kv_heads=2,
                  head_dim=64, block_size=16)
    fields.update(overrides)
    return Fingerprint(**fields)


def _serve(conn, num_blocks: int, block_bytes: int, cfg: dict, fp: dict, env: dict) -> None:
    os.environ.update(env)
    from kv_transfer import KVExporter, TransferConfig

    pool = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
    free = set(range(1, num_blocks))
    lock = threading.Lock()

    def on_free(request_id: str, block_ids: list[int]) -> None:
        with lock:
            assert not free.intersection(block_ids), "double free"
            free.update(block_ids)

    exp = KVExporter(pool, TransferConfig(**cfg), fingerprint(**fp), on_free, engine_id="p0")
    conn.send((exp.address, exp.instance_id))
    while True:
        cmd, *args = conn.recv()
        if cmd == "hold":
            conn.send(_hold(exp, pool, free, lock, *args))
        elif cmd == "abort":
            conn.send(exp.abort(args[0]))
        elif cmd == "stats":
            with lock:
                conn.send((len(free), exp.num_leases(), exp.metrics()))
        elif cmd == "exit":
            exp.close()
            conn.send(True)
            return


def _hold(exp, pool, free, lock, request_id, num_or_ids, seed, ttl_s):
    """Take blocks (a count: random free blocks; a list: exactly those), fill, lease."""
    with lock:
        if isinstance(num_or_ids, int):
            if num_or_ids > len(free):
                return None
            rng = np.random.default_rng(seed)
            ids = [int(b) for b in rng.choice(sorted(free), num_or_ids, replace=False)]
        else:
            ids = list(num_or_ids)
        free.difference_update(ids)
    for i, b in enumerate(ids):
        pool[b] = pattern(seed, i, pool.shape[1])
    try:
        return exp.hold(request_id, ids, num_tokens=16 * len(ids), ttl_s=ttl_s)
    except ValueError as exc:
        with lock:
            free.update(ids)
        return str(exc)


class PeerProcess:
    """Handle on one exporter process."""

    def __init__(self, num_blocks: int = 64, block_bytes: int = 16384,
                 cfg: dict | None = None, fp: dict | None = None,
                 env: dict | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.proc = ctx.Process(target=_serve, daemon=True, args=(
            child, num_blocks, block_bytes, cfg or {}, fp or {}, {**TEST_ENV, **(env or {})}))
        self.proc.start()
        if not self.conn.poll(30):
            raise RuntimeError("exporter process did not start")
        self.address, self.instance_id = self.conn.recv()

    def call(self, *cmd: Any, timeout: float = 10.0) -> Any:
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd[0]}")
        return self.conn.recv()

    def hold(self, request_id: str, num_or_ids, seed: int, ttl_s: float | None = None):
        return self.call("hold", request_id, num_or_ids, seed, ttl_s)

    def stats(self) -> tuple[int, int, dict]:
        return self.call("stats")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=10)
            except (TimeoutError, OSError, EOFError):
                pass
            self.proc.join(5)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


def _pull_serve(conn, num_blocks: int, block_bytes: int, cfg: dict, env: dict) -> None:
    """A completion-engine stand-in: a KVImporter over a numpy pool, driven by the parent."""
    os.environ.update(env)
    import time

    from kv_transfer import KVImporter, TransferConfig

    pool = np.zeros((num_blocks, block_bytes), dtype=np.uint8)
    imp = KVImporter(pool, TransferConfig(**cfg), fingerprint(), engine_id="c0")
    seeds: dict[str, tuple[int, list[int]]] = {}
    done: dict[str, Any] = {}
    conn.send(True)
    while True:
        cmd, *args = conn.recv()
        if cmd == "start":
            handle, ids, seed = args
            seeds[handle.request_id] = (seed, ids)
            imp.start_pull(handle, ids)
            conn.send(True)
        elif cmd == "state":
            conn.send(done[args[0]].state if args[0] in done else imp.poll(args[0]))
        elif cmd == "wait":
            end = time.monotonic() + args[1]
            while args[0] not in done and time.monotonic() < end:
                done.update((r.request_id, r) for r in imp.collect())
                time.sleep(0.002)
            r = done.pop(args[0], None)
            if r is None:
                conn.send(None)
                continue
            seed, ids = seeds.pop(args[0])
            exact = all(np.array_equal(pool[b], pattern(seed, i, block_bytes))
                        for i, b in enumerate(ids))
            conn.send((int(r.state), r.reason, r.message, exact, r.num_descs))
        elif cmd == "stats":
            conn.send((imp.num_pending(), imp.metrics()))
        elif cmd == "exit":
            imp.close()
            conn.send(True)
            return


class ImporterProcess(PeerProcess):
    """Handle on one importer process (same call/kill/stop as the exporter's)."""

    def __init__(self, num_blocks: int = 64, block_bytes: int = 16384,
                 cfg: dict | None = None, env: dict | None = None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.proc = ctx.Process(target=_pull_serve, daemon=True, args=(
            child, num_blocks, block_bytes, cfg or {}, {**TEST_ENV, **(env or {})}))
        self.proc.start()
        if not self.conn.poll(30):
            raise RuntimeError("importer process did not start")
        self.conn.recv()

    def pull(self, handle, ids: list[int], seed: int, timeout: float = 20.0):
        self.call("start", handle, ids, seed)
        return self.call("wait", handle.request_id, timeout, timeout=timeout + 5)
