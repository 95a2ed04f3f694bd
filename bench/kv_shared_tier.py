"""The shared cluster tier (README: KV tiers): which store, and what a shared hit saves, in one run.

    .venv/bin/python bench/kv_shared_tier.py                      # Redis only, ~5 min on 2 busy cores
    .venv/bin/python bench/kv_shared_tier.py --mooncake-python /path/to/venv/bin/python

1. Store throughput at this model's block size: `--blocks` KV blocks of the default model
   (the bytes the tier writes: fingerprint header + record) put and got between two processes,
   in batches of the tier's READ_BATCH, `--reps` times, the stores interleaved rep by rep:
   Redis (a redis-server started here, maxmemory + allkeys-lru, through the tier's own client,
   baton/ops/kv_store.py) and, with `--mooncake-python`, Mooncake Store (a mooncake_master, one
   process holding the memory segment, one client process putting and getting over TCP; that
   interpreter needs the `mooncake-transfer-engine-non-cuda` wheel, which is not a dependency).
2. What a shared hit saves: engine A computes a fresh `--prefix-tokens` prefix and publishes it;
   engine B (its own pool, over the store) and engine C (no tier: recompute) then serve a prompt
   of that prefix plus a question, in alternating order, TTFT timed in the engine (add_request to
   the first token), greedy; B's and C's answers must be identical. The median ratio B/C is the
   router's SHARED_HIT_WEIGHT = 1 - ratio (router/selection.py).
Writes bench/results/kv_shared_tier.json and prints tables; the machine's load is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kv_disk_tier import timed_turn  # bench/kv_disk_tier.py: the same one-request timing

RESULTS = Path(__file__).resolve().parent / "results" / "kv_shared_tier.json"


# ---------------------------------------------------------------------- Mooncake (its own venv)
def mooncake_worker(role: str, master: str, metadata: str, num_blocks: int,
                    block_bytes: int) -> None:
    """Runs under the Mooncake interpreter (stdlib, numpy, mooncake only). holder: contributes
    the memory and sleeps; client: one line of JSON per "rep N" line on stdin."""
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    segment = 2 << 30 if role == "holder" else 0
    rc = store.setup("127.0.0.1", metadata, segment, 256 << 20, "tcp", "", master)
    print(json.dumps({"ready": rc == 0, "rc": rc}), flush=True)
    if role == "holder":
        sys.stdin.readline()  # until the bench closes the pipe
        return
    rng = np.random.default_rng(0)
    values = [rng.integers(0, 255, block_bytes, dtype=np.uint8).tobytes()
              for _ in range(num_blocks)]
    for line in sys.stdin:
        rep = int(line.split()[1])
        names = [f"rep{rep}-{i}" for i in range(num_blocks)]
        t0 = time.perf_counter()
        for name, value in zip(names, values, strict=True):
            assert store.put(name, value) == 0
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = [store.get(name) for name in names]
        get_s = time.perf_counter() - t0
        assert all(bytes(g) == v for g, v in zip(got, values, strict=True))
        print(json.dumps({"put_s": put_s, "get_s": get_s}), flush=True)


class Mooncake:
    """A master, a holder and a client process of Mooncake Store under another interpreter."""

    def __init__(self, python: str, num_blocks: int, block_bytes: int) -> None:
        from baton.ops.ports import free_port

        where = subprocess.run([python, "-c", "import mooncake, os; "
                                "print(os.path.dirname(mooncake.__file__))"],
                               capture_output=True, text=True, check=True).stdout.strip()
        rpc, http, metrics = free_port(), free_port(), free_port()
        self.logs = tempfile.TemporaryFile()
        self.master = subprocess.Popen(
            [os.path.join(where, "mooncake_master"), f"-rpc_port={rpc}",
             "-enable_http_metadata_server=true", f"-http_metadata_server_port={http}",
             f"-metrics_port={metrics}"], stdout=self.logs, stderr=subprocess.STDOUT)
        time.sleep(2.0)
        args = [f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata", str(num_blocks),
                str(block_bytes)]
        self.procs = [self._worker(python, "holder", args)]
        self.procs.append(self._worker(python, "client", args))

    def _worker(self, python: str, role: str, args: list[str]) -> subprocess.Popen:
        proc = subprocess.Popen([python, __file__, "--mooncake-worker", role, *args],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=self.logs, text=True)
        ready = json.loads(proc.stdout.readline())
        if not ready["ready"]:
            raise RuntimeError(f"mooncake {role}: setup returned {ready['rc']}")
        return proc

    def rep(self, rep: int) -> dict[str, float]:
        client = self.procs[1]
        client.stdin.write(f"rep {rep}\n")
        client.stdin.flush()
        return json.loads(client.stdout.readline())

    def close(self) -> None:
        for proc in self.procs:
            proc.stdin.close()
            proc.wait(timeout=30)
        self.master.terminate()
        self.master.wait(timeout=30)


# ---------------------------------------------------------------------- Redis (the tier's client)
class RedisArm:
    def __init__(self, values: list[bytes]) -> None:
        from baton.ops.kv_store import RedisKvStore
        from baton.ops.redis_server import RedisServer

        self.server = RedisServer(maxmemory_bytes=2 << 30).start()
        self.store = RedisKvStore(self.server.url, self.server.password_file, timeout_s=10.0)
        self.values = values

    def rep(self, rep: int, batch: int) -> dict[str, float]:
        names = [f"bench:rep{rep}-{i}" for i in range(len(self.values))]
        t0 = time.perf_counter()
        for i in range(0, len(names), batch):
            self.store.put_many(list(zip(names[i:i + batch], self.values[i:i + batch],
                                         strict=True)))
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = []
        for i in range(0, len(names), batch):
            got += self.store.get_many(names[i:i + batch])
        get_s = time.perf_counter() - t0
        assert got == self.values
        return {"put_s": put_s, "get_s": get_s}

    def close(self) -> None:
        self.store.close()
        self.server.stop()


def summarize(reps: list[dict[str, float]], nbytes: int, num_blocks: int) -> dict:
    out = {}
    for what in ("put", "get"):
        rates = [nbytes / r[f"{what}_s"] / 2**20 for r in reps]
        per_block = [1e3 * r[f"{what}_s"] / num_blocks for r in reps]
        out[what] = {"MiB_s_median": statistics.median(rates), "MiB_s_min": min(rates),
                     "MiB_s_max": max(rates), "ms_per_block_median": statistics.median(per_block)}
    return out


def store_throughput(args, block_values: list[bytes]) -> dict:
    from baton.engine.kv_shared import READ_BATCH

    arms = {"redis": RedisArm(block_values)}
    if args.mooncake_python:
        arms["mooncake"] = Mooncake(args.mooncake_python, len(block_values),
                                    len(block_values[0]))
    reps = {name: [] for name in arms}
    try:
        for rep in range(args.reps):
            for name, arm in (arms.items() if rep % 2 == 0 else reversed(arms.items())):
                reps[name].append(arm.rep(rep, READ_BATCH) if name == "redis" else arm.rep(rep))
    finally:
        for arm in arms.values():
            arm.close()
    nbytes = sum(len(v) for v in block_values)
    return {name: {"reps": r, **summarize(r, nbytes, len(block_values))}
            for name, r in reps.items()}


# ---------------------------------------------------------------------- TTFT with a shared hit


def shared_hit_ttft(args, loaded, store) -> dict:
    from pydoc_data.topics import topics

    from baton.engine import EngineConfig, LLMEngine
    from baton.sampling.params import SamplingParams

    def engine(shared: bool) -> LLMEngine:
        return LLMEngine(EngineConfig(num_blocks=args.num_blocks, num_threads=args.threads),
                         loaded=loaded, shared_store=store if shared else None)

    ids = loaded.tokenizer.encode("\n\n".join(topics[k] for k in sorted(topics)))
    question = loaded.tokenizer.encode(" In one sentence, what is this about?")
    params = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True)
    publisher, reader, cold = engine(True), engine(True), engine(False)
    turns = []
    for rep in range(args.ttft_reps):
        start = (rep + 1) * 5 * args.prefix_tokens  # a fresh prefix each rep: no pool hit
        prefix = ids[start:start + args.prefix_tokens]
        timed_turn(publisher, prefix + question[:1], params)
        publisher.shared.flush()
        prompt = prefix + question
        result = {}
        for mode, eng in ((("shared", reader), ("recompute", cold)) if rep % 2 == 0
                          else (("recompute", cold), ("shared", reader))):
            ttft, answer, cached = timed_turn(eng, prompt, params)
            result[mode] = {"ttft_s": ttft, "cached_tokens": cached, "answer": answer}
        turns.append({"rep": rep, "prompt_tokens": len(prompt),
                      "same_answer": result["shared"]["answer"] == result["recompute"]["answer"],
                      **{m: {k: v for k, v in r.items() if k != "answer"}
                         for m, r in result.items()}})
        print(f"rep {rep}: shared {1e3 * result['shared']['ttft_s']:.0f} ms, recompute "
              f"{1e3 * result['recompute']['ttft_s']:.0f} ms; load {os.getloadavg()[0]:.1f}",
              flush=True)
    ratios = [t["shared"]["ttft_s"] / t["recompute"]["ttft_s"] for t in turns]
    tiers = reader.tier_stats()
    for eng in (publisher, reader, cold):
        eng.close()
    return {"turns": turns, "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios),
            "answers_differing": sum(not t["same_answer"] for t in turns),
            "reader_tier_stats": tiers}


def block_values(loaded, num: int) -> tuple[list[bytes], int]:
    """`num` values as the tier writes them, from a real engine's pool blocks."""
    import numpy as np

    from baton.engine import EngineConfig, LLMEngine
    from baton.engine.kv_disk_store import encode_record, fingerprint_header

    engine = LLMEngine(EngineConfig(num_blocks=8), loaded=loaded)
    block = engine.runner.read_blocks(np.array([1]))[0]
    header = fingerprint_header(engine.kv_fingerprint)
    tokens = np.arange(engine.config.block_size, dtype=np.int32)
    rng = np.random.default_rng(0)
    values = []
    for i in range(num):
        data = rng.integers(0, 255, block.nbytes, dtype=np.uint8)
        values.append(header + encode_record(i, 0, tokens, data))
    return values, block.nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--blocks", type=int, default=64, help="blocks per throughput rep")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--mooncake-python", default="",
                   help="an interpreter with mooncake-transfer-engine-non-cuda installed")
    p.add_argument("--prefix-tokens", type=int, default=256)
    p.add_argument("--answer-tokens", type=int, default=4)
    p.add_argument("--ttft-reps", type=int, default=5)
    p.add_argument("--num-blocks", type=int, default=64, help="each engine's pool")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--mooncake-worker", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mooncake_worker:
        role, master, metadata, num, nbytes = args.mooncake_worker
        mooncake_worker(role, master, metadata, int(num), int(nbytes))
        return
    import torch
    from repo_paths import relative_args  # a sibling script, not a package

    from baton.model import load_model
    from baton.ops.kv_store import RedisKvStore
    from baton.ops.redis_server import RedisServer

    torch.set_num_threads(args.threads)
    loaded = load_model(quantization="none", device="cpu")
    load_before = os.getloadavg()
    values, block_bytes = block_values(loaded, args.blocks)
    stores = store_throughput(args, values)
    with RedisServer(maxmemory_bytes=1 << 30) as server:
        store = RedisKvStore(server.url, server.password_file, timeout_s=5.0)
        ttft = shared_hit_ttft(args, loaded, store)
        store.close()
    result = {"args": relative_args(vars(args)), "load_avg_before": load_before,
              "load_avg_after": os.getloadavg(), "block_bytes": block_bytes,
              "value_bytes": len(values[0]), "stores": stores, "shared_hit": ttft,
              "shared_hit_weight": 1 - ttft["ratio_median"]}
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"block {block_bytes} bytes ({len(values[0])} with header and record), "
          f"{args.blocks} blocks x {args.reps} reps; load {load_before[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    print("| store | put MiB/s median [min-max] | get MiB/s median [min-max] | "
          "get ms/block |")
    print("|---|---|---|---:|")
    for name, s in stores.items():
        put, get = s["put"], s["get"]
        print(f"| {name} | {put['MiB_s_median']:.0f} [{put['MiB_s_min']:.0f}-"
              f"{put['MiB_s_max']:.0f}] | {get['MiB_s_median']:.0f} [{get['MiB_s_min']:.0f}-"
              f"{get['MiB_s_max']:.0f}] | {get['ms_per_block_median']:.2f} |")
    print(f"shared hit / recompute TTFT median {ttft['ratio_median']:.2f}x "
          f"[{ttft['ratio_min']:.2f}-{ttft['ratio_max']:.2f}] over {args.ttft_reps} prompts of "
          f"{args.prefix_tokens} + question tokens; answers differing: "
          f"{ttft['answers_differing']}; weight 1 - ratio = {result['shared_hit_weight']:.2f}")


if __name__ == "__main__":
    main()
