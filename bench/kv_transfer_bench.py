"""KV transfer benchmark: NIXL READ throughput and prompt-KV pull latency vs memcpy.

    .venv/bin/python bench/kv_transfer_bench.py [--mib 128] [--runs 5]

For each path (same host: UCX CMA; TCP: UCX_TLS=^cma, what two hosts without RDMA would do)
an exporter and an importer run in two processes. Each pull moves scattered blocks (random
local and remote ids, so descriptors barely merge: one per block), then contiguous ones (ids
1..n on both sides: one merged descriptor), of 16 KiB, 64 KiB and the default model's
block (SmolLM2-135M: 30 layers x 2 x 16 tokens x 3 KV heads x 64 x fp32 = 737,280 bytes).
GB/s counts the NIXL transfer (post to completion); "e2e" adds the claim round trip. The
baseline is an in-process memcpy of the same number of bytes. Latency: the whole pull
(claim + READ + result) of the KV of a 1024- and a 4096-token prompt, scattered blocks. Medians of --runs.
Writes bench/results/kv_transfer.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import time

import numpy as np

MODEL_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # 737,280 bytes
BLOCK_SIZES = [16 << 10, 64 << 10, MODEL_BLOCK]
PROMPTS = [1024, 4096]  # tokens; 16 tokens per block
BASE_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
PATHS = {"same-host": {}, "tcp": {"UCX_TLS": "^cma"}}
HERE = os.path.dirname(os.path.abspath(__file__))


def _fingerprint():
    from kv_transfer import Fingerprint

    return Fingerprint("SmolLM2-135M", "float32", 30, 3, 64, 16)


def _exporter_main(conn, env: dict) -> None:
    """Exporter process: builds a pool on request and leases (scattered) blocks of it."""
    os.environ.update(env)
    from kv_transfer import KVExporter, TransferConfig

    exp, pool = None, None
    while True:
        cmd, *args = conn.recv()
        if cmd == "pool":
            if exp is not None:
                exp.close()
            pool = np.ones((args[0], args[1]), dtype=np.uint8)  # touched: no page faults later
            # The transport alone: block checksums (on by default) are bench/kv_integrity_bench.py's
            exp = KVExporter(pool, TransferConfig(checksum="off"), _fingerprint(),
                             lambda r, b: None, "bench-p")
            conn.send(None)
        elif cmd == "hold":
            end = time.monotonic() + 5  # the previous pull's release note may be in flight
            while exp.num_leases() and time.monotonic() < end:
                time.sleep(0.001)
            conn.send(exp.hold(args[0], args[1], num_tokens=16 * len(args[1])))
        else:
            if exp is not None:
                exp.close()
            conn.send(None)
            return


def _path_main(conn, env: dict, mib: int, runs: int) -> None:
    """Importer process of one path: runs every measurement against its own exporter."""
    os.environ.update(env)
    from kv_transfer import KVImporter, TransferConfig, TransferState

    ctx = mp.get_context("spawn")
    econn, child = ctx.Pipe()
    proc = ctx.Process(target=_exporter_main, args=(child, env), daemon=True)
    proc.start()
    rng = np.random.default_rng(0)
    out: dict = {"throughput": [], "latency": []}

    def call(*cmd):
        econn.send(cmd)
        if not econn.poll(60):
            raise RuntimeError(f"exporter did not answer {cmd[0]}")
        return econn.recv()

    def ids(num_blocks, num_pull, scattered):
        if not scattered:
            return list(range(1, num_pull + 1))
        return [int(x) + 1 for x in rng.permutation(num_blocks - 1)[:num_pull]]

    def pull_all(block_bytes, num_pull, num_blocks, reps, name, scattered=True):
        call("pool", num_blocks, block_bytes)
        # touched like a live engine's pool, so page faults are not part of the figure
        pool = np.ones((num_blocks, block_bytes), dtype=np.uint8)
        imp = KVImporter(pool, TransferConfig(), _fingerprint(), "bench-c")
        results = []
        for i in range(reps + 1):  # first run warms the handshake and UCX connection
            remote = ids(num_blocks, num_pull, scattered)
            local = ids(num_blocks, num_pull, scattered)
            handle = call("hold", f"{name}-{i}", remote)
            r = imp.transfer(handle, local)
            assert r.state == TransferState.DONE, r
            if i:
                results.append(r)
        imp.close()
        return results

    try:
        if not econn.poll(0) and not proc.is_alive():
            raise RuntimeError("exporter process died")
        for bb, scattered in [(b, s) for s in (True, False) for b in BLOCK_SIZES]:
            n = (mib << 20) // bb
            rs = pull_all(bb, n, n + 1, runs, f"tp{bb}{scattered}", scattered)
            out["throughput"].append({
                "block_bytes": bb, "num_blocks": n, "bytes": n * bb,
                "pattern": "scattered" if scattered else "contiguous",
                "num_descs": statistics.median(r.num_descs for r in rs),
                "xfer_s": statistics.median(r.xfer_seconds for r in rs),
                "e2e_s": statistics.median(r.seconds for r in rs)})
        biggest = max(PROMPTS) // 16
        for tokens in PROMPTS:
            rs = pull_all(MODEL_BLOCK, tokens // 16, biggest + 1, runs, f"lat{tokens}")
            out["latency"].append({
                "tokens": tokens, "num_blocks": tokens // 16, "bytes": tokens // 16 * MODEL_BLOCK,
                "pull_s": statistics.median(r.seconds for r in rs),
                "xfer_s": statistics.median(r.xfer_seconds for r in rs)})
    finally:
        call("exit")
        proc.join(10)
    conn.send(out)


def memcpy_gbps(nbytes: int, runs: int) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9


def run_path(env: dict, mib: int, runs: int) -> dict:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_path_main, args=(child, {**BASE_ENV, **env}, mib, runs))
    proc.start()
    if not conn.poll(900):
        proc.kill()
        raise RuntimeError("benchmark path runner timed out")
    out = conn.recv()
    proc.join(30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="MiB per throughput pull")
    ap.add_argument("--runs", type=int, default=5, help="measured runs per point (median)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kv_transfer.json"))
    args = ap.parse_args()
    memcpy = memcpy_gbps(args.mib << 20, args.runs * 2)
    report = {"memcpy_gbps": memcpy, "mib_per_pull": args.mib, "runs": args.runs,
              "host": platform.node(), "cpus": os.cpu_count(), "paths": {}}
    for name, env in PATHS.items():
        res = run_path(env, args.mib, args.runs)
        for row in res["throughput"]:
            row["gbps"] = row["bytes"] / row["xfer_s"] / 1e9
            row["e2e_gbps"] = row["bytes"] / row["e2e_s"] / 1e9
            row["vs_memcpy"] = row["gbps"] / memcpy
        report["paths"][name] = res
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print_table(report)


def print_table(report: dict) -> None:
    print(f"memcpy {report['memcpy_gbps']:.2f} GB/s ({report['mib_per_pull']} MiB, in-process)")
    print(f"{'path':<10} {'pattern':<10} {'block':>8} {'blocks':>6} {'descs':>6} {'GB/s':>7} "
          f"{'e2e':>7} {'%memcpy':>8}")
    for name, res in report["paths"].items():
        for r in res["throughput"]:
            print(f"{name:<10} {r['pattern']:<10} {r['block_bytes']:>8} {r['num_blocks']:>6} "
                  f"{r['num_descs']:>6.0f} "
                  f"{r['gbps']:>7.2f} {r['e2e_gbps']:>7.2f} {100 * r['vs_memcpy']:>7.0f}%")
    print(f"{'path':<10} {'tokens':>8} {'MiB':>6} {'pull ms':>8} {'xfer ms':>8}")
    for name, res in report["paths"].items():
        for r in res["latency"]:
            print(f"{name:<10} {r['tokens']:>8} {r['bytes'] / 2**20:>6.1f} "
                  f"{1e3 * r['pull_s']:>8.2f} {1e3 * r['xfer_s']:>8.2f}")


if __name__ == "__main__":
    main()
