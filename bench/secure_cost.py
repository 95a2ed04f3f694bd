"""What authenticated wires cost: CURVE (+ lease credential) on against `--insecure`.

    .venv/bin/python bench/secure_cost.py [--rounds 3] [--requests 5] [--kv-reps 7]

Serving: two `baton up` clusters (one prompt + one completion engine each, one torch thread per
engine, no CPU pinning), one with its generated keys and one `--insecure`, started once and
measured in interleaved runs (on, off, then off, on, ...) so that load drifting on a shared host
hits both alike. A run sends --requests streamed /v1/completions one at a time (concurrency 1,
greedy, ignore_eos, --max-tokens tokens) and keeps the run's median TTFT and TPOT.
KV pulls: an exporter process and an in-process importer per mode, interleaved the same way;
each rep pulls a 1-block handle (the claim round trip dominates: where CURVE could show) and a
--kv-mib MiB handle (the NIXL READ dominates; it never crosses ZMQ, so CURVE cannot slow it).
Wire: round trips of one one-token TokenDelta (what each streamed token costs on the engine
wire) between a DEALER and a ROUTER on loopback, CURVE against NULL, in interleaved batches:
the per-token price of the encryption without the serving runs' noise (on a loaded 2-core host
the serving medians swing by more than the effect).
Prints medians and spread (min..max) of the runs; writes bench/results/secure_cost.json.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODEL_BLOCK = 30 * 2 * 16 * 3 * 64 * 4  # SmolLM2-135M fp32: 737,280 bytes per block
MODES = ("curve", "insecure")
KV_ENV = {"UCX_NET_DEVICES": "lo", "NIXL_LOG_LEVEL": "WARN"}
IDLE_TPOT_MS = 13.8  # the README's c1 TPOT of the default model on an idle 2-core host
PROMPT = ("The history of the city begins with a small town by the river where people built "
          "houses, roads and a market; over the years the town grew into a place of trade and ")


# ---------------------------------------------------------------------------- serving
def start_cluster(mode: str, port: int, key_env: dict, log_dir: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "baton_cli", "up", "--port", str(port), "--no-cpu-pinning",
            "--no-metrics", *(["--insecure"] if mode == "insecure" else []),
            "--", "--num-threads", "1"]
    log = open(log_dir / f"baton_up_{mode}.log", "w")  # noqa: SIM115 (lives with the child)
    return subprocess.Popen(argv, cwd=ROOT, env=key_env, stdout=subprocess.PIPE,
                            stderr=log, text=True, start_new_session=True)


def wait_up(proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError("baton up exited during start-up")
        if line.startswith("Baton is up"):
            return
    raise RuntimeError("baton up not ready in time")


def one_request(port: int, max_tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one streamed completion."""
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "stream": True,
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    times = []
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            if json.loads(line[6:])["choices"][0].get("text"):
                times.append(time.perf_counter())
    conn.close()
    ttft = times[0] - start
    return ttft, (times[-1] - times[0]) / max(1, len(times) - 1)


def serving(args: argparse.Namespace) -> dict:
    from kv_transfer.auth import ENV_KEY_DIR

    env = {k: v for k, v in os.environ.items() if k != ENV_KEY_DIR}  # baton up makes its own
    ports = {"curve": args.port, "insecure": args.port + 1}
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {m: start_cluster(m, ports[m], env, log_dir) for m in MODES}
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    errors = {m: [] for m in MODES}
    try:
        for m in MODES:
            wait_up(procs[m], 600)
            one_request(ports[m], 4)  # warm-up: first-request paths, handshakes
        for r in range(args.rounds):
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                samples = []
                for _ in range(args.requests):
                    try:
                        samples.append(one_request(ports[m], args.max_tokens))
                    except (OSError, AssertionError) as exc:  # kept in the report, not hidden
                        errors[m].append(f"round {r}: {exc!r}")
                        print(f"  round {r} {m}: request failed: {exc!r}", flush=True)
                if not samples:
                    continue
                runs[m].append({"ttft_ms": 1e3 * statistics.median(s[0] for s in samples),
                                "tpot_ms": 1e3 * statistics.median(s[1] for s in samples)})
                print(f"  round {r} {m:<9} ttft {runs[m][-1]['ttft_ms']:7.1f} ms  "
                      f"tpot {runs[m][-1]['tpot_ms']:6.1f} ms", flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    return runs, errors


# ---------------------------------------------------------------------------- KV pulls
def _fingerprint():
    from kv_transfer import Fingerprint

    return Fingerprint("SmolLM2-135M", "float32", 30, 3, 64, 16)


def _exporter_main(conn, key_dir: str, num_blocks: int) -> None:
    os.environ.update(KV_ENV)
    from kv_transfer import KVExporter, TransferConfig
    from kv_transfer.auth import ClusterKeys

    keys = ClusterKeys.load(key_dir) if key_dir else None
    pool = np.ones((num_blocks, MODEL_BLOCK), dtype=np.uint8)
    exp = KVExporter(pool, TransferConfig(keys=keys), _fingerprint(), lambda r, b: None, "p")
    conn.send(exp.address)
    while True:
        cmd, *rest = conn.recv()
        if cmd == "exit":
            exp.close()
            conn.send(None)
            return
        end = time.monotonic() + 5  # the previous pull's release may be in flight
        while exp.num_leases() and time.monotonic() < end:
            time.sleep(0.001)
        conn.send(exp.hold(rest[0], rest[1], num_tokens=16 * len(rest[1])))


def kv_pulls(args: argparse.Namespace) -> dict:
    os.environ.update(KV_ENV)
    from kv_transfer import KVImporter, TransferConfig, TransferState
    from kv_transfer.auth import ClusterKeys, generate

    key_dir = str(generate())
    n_big = max(1, (args.kv_mib << 20) // MODEL_BLOCK)
    ctx = mp.get_context("spawn")
    sides = {}
    for m in MODES:
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_exporter_main, daemon=True,
                           args=(child, key_dir if m == "curve" else "", n_big + 1))
        proc.start()
        assert conn.poll(60), "exporter did not start"
        conn.recv()
        keys = ClusterKeys.load(key_dir) if m == "curve" else None
        pool = np.ones((n_big + 1, MODEL_BLOCK), dtype=np.uint8)
        sides[m] = (conn, proc, KVImporter(pool, TransferConfig(keys=keys), _fingerprint(),
                                           f"c-{m}"))
    out: dict[str, dict[str, list[float]]] = {m: {"small_ms": [], "big_gbps": []} for m in MODES}

    def pull(m: str, rid: str, ids: list[int]) -> float:
        conn, _, imp = sides[m]
        conn.send(("hold", rid, ids))
        assert conn.poll(30)
        r = imp.transfer(conn.recv(), ids)
        assert r.state == TransferState.DONE, r
        return r.seconds

    try:
        for m in MODES:  # warm: handshake and UCX connection
            pull(m, f"warm-{m}", [1])
        for rep in range(args.kv_reps):
            for m in (MODES if rep % 2 == 0 else MODES[::-1]):
                out[m]["small_ms"].append(1e3 * pull(m, f"s{rep}", [1 + rep % n_big]))
                big = list(range(1, n_big + 1))
                out[m]["big_gbps"].append(n_big * MODEL_BLOCK / pull(m, f"b{rep}", big) / 1e9)
    finally:
        for conn, proc, imp in sides.values():
            imp.close()
            conn.send(("exit",))
            conn.poll(10)
            proc.join(10)
        import shutil

        shutil.rmtree(key_dir, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------- the wire
def wire_rtt(args: argparse.Namespace) -> dict:
    """Round trips of one engine-wire message (a one-token TokenDelta, what every streamed
    token costs) between a DEALER and a ROUTER on loopback, CURVE against NULL, interleaved in
    batches: the per-token price of the encryption, free of the serving runs' noise."""
    import threading

    import zmq

    from baton.protocol import TokenDelta, encode
    from kv_transfer.auth import ClusterKeys, generate

    key_dir = str(generate())
    keys = ClusterKeys.load(key_dir)
    msg = encode(TokenDelta("cmpl-0123456789abcdef0123456789abcdef", token_ids=[1234],
                            logprobs=[-0.5]))
    ctx = zmq.Context()
    pairs = {}
    try:
        for m in MODES:
            server, client = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
            for sock in (server, client):
                sock.setsockopt(zmq.LINGER, 0)
            if m == "curve":
                keys.apply_server(server, "bench")
                keys.apply_client(client)
            port = server.bind_to_random_port("tcp://127.0.0.1")
            client.connect(f"tcp://127.0.0.1:{port}")
            stop = threading.Event()

            def echo(sock=server, stop=stop) -> None:
                poller = zmq.Poller()
                poller.register(sock, zmq.POLLIN)
                while not stop.is_set():
                    if poller.poll(50):
                        sock.send_multipart(sock.recv_multipart())
            thread = threading.Thread(target=echo, daemon=True)
            thread.start()
            pairs[m] = (server, client, stop, thread)
        out: dict[str, list[float]] = {m: [] for m in MODES}

        def batch(m: str, n: int) -> float:
            client = pairs[m][1]
            start = time.perf_counter()
            for _ in range(n):
                client.send(msg)
                client.recv()
            return 1e6 * (time.perf_counter() - start) / n

        for m in MODES:
            batch(m, 200)  # handshake, warm
        for rep in range(args.wire_reps):
            for m in (MODES if rep % 2 == 0 else MODES[::-1]):
                out[m].append(batch(m, args.wire_batch))
        return out
    finally:
        for server, client, stop, thread in pairs.values():
            stop.set()
            thread.join(2)
            server.close()
            client.close()
        from kv_transfer.auth import stop_authenticator

        stop_authenticator(ctx)
        ctx.term()
        import shutil

        shutil.rmtree(key_dir, ignore_errors=True)


# ---------------------------------------------------------------------------- report
def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved serving runs per mode")
    ap.add_argument("--requests", type=int, default=5, help="requests per serving run (c1)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--port", type=int, default=18300, help="router ports: PORT and PORT+1")
    ap.add_argument("--kv-reps", type=int, default=7, help="interleaved KV pulls per mode")
    ap.add_argument("--kv-mib", type=int, default=32, help="MiB of the large KV pull")
    ap.add_argument("--wire-reps", type=int, default=11, help="interleaved wire batches per mode")
    ap.add_argument("--wire-batch", type=int, default=2000, help="round trips per wire batch")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--log-dir", default="/tmp/secure_cost_logs", help="baton up logs")
    ap.add_argument("--out", default=str(HERE / "results" / "secure_cost.json"))
    args = ap.parse_args()
    report: dict = {"host_cpus": os.cpu_count(), "python": platform.python_version(),
                    # no paths of this machine in a committed result
                    "args": {k: v for k, v in vars(args).items() if k not in ("out", "log_dir")},
                    "serving": {}, "kv": {}}
    print("wire round trips (interleaved):", flush=True)
    report["wire"] = {m: {"rtt_us": summary(v)} for m, v in wire_rtt(args).items()}
    print("KV pulls (interleaved):", flush=True)
    kv = kv_pulls(args)
    report["kv"] = {m: {k: summary(v) for k, v in d.items()} for m, d in kv.items()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))  # the KV part survives a failure
    print_table(report)
    if not args.skip_serving:
        print("serving, c1 (interleaved):", flush=True)
        runs, errors = serving(args)
        report["serving"] = {m: {k: summary([r[k] for r in rs]) for k in ("ttft_ms", "tpot_ms")}
                             for m, rs in runs.items() if rs}
        report["serving_errors"] = errors
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print_table(report)


def print_table(report: dict) -> None:
    rows = [("wire", "token RTT us", "rtt_us"), ("kv", "1-block pull ms", "small_ms"), ("kv", "large pull GB/s", "big_gbps"),
            ("serving", "c1 TTFT ms", "ttft_ms"), ("serving", "c1 TPOT ms", "tpot_ms")]
    print(f"{'figure':<18} {'curve (min..max)':>26} {'insecure (min..max)':>26} {'cost':>7}")
    for part, name, key in rows:
        if set(report.get(part, {})) != set(MODES):
            continue
        on, off = report[part]["curve"][key], report[part]["insecure"][key]
        worse = off["median"] / on["median"] - 1 if key == "big_gbps" else \
            on["median"] / off["median"] - 1
        print(f"{name:<18} {on['median']:>9.2f} ({on['min']:.2f}..{on['max']:.2f})"
              f"{'':>2} {off['median']:>9.2f} ({off['min']:.2f}..{off['max']:.2f})"
              f"{'':>2} {100 * worse:>+6.1f}%")
    if set(report.get("wire", {})) == set(MODES):
        extra_us = (report["wire"]["curve"]["rtt_us"]["median"]
                    - report["wire"]["insecure"]["rtt_us"]["median"])
        serving = report.get("serving", {}).get("insecure")
        tpot_ms = serving["tpot_ms"]["median"] if serving else IDLE_TPOT_MS
        print(f"CURVE per streamed token: {extra_us:+.0f} us a round trip (a token crosses the "
              f"engine wire once), {100 * extra_us / 1e3 / tpot_ms:+.2f}% of a {tpot_ms:.1f} ms "
              f"TPOT ({'this run' if serving else 'the README idle c1 figure'})")


if __name__ == "__main__":
    main()
