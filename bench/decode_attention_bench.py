"""One layer's decode attention for n single-token sequences, two ways, interleaved in one process:
  eager  the eager formulas one sequence at a time (RoPE, the K/V write into the dense row,
         softmax(q k^T / sqrt(d)) v per KV-head group as torch matmuls); the exact mode's
         backend batches a uniform group with one bmm, so at batch > 1 this baseline is slower
         than that path
  fused  torch.ops.baton_decode.decode_attention (csrc/kernels/decode_attention.cpp) over the
         dense rows: the reference of
  paged  torch.ops.baton_decode.decode_attention_paged, the quantized modes' op: the same
         arithmetic over the block pool [blocks, L, 2, 16, Hkv, D] through each sequence's block
         table (its blocks drawn at random from the pool: no locality assumed)
SmolLM2's shapes (9 query heads, 3 KV heads, head size 64, `--layers` layers of rows and pool,
30 by default). Prints microseconds per call (median, min-max over the repeats, ratio to eager)
and writes JSON. `--skip-eager` leaves the slow baseline out (ratios then to fused).
`--clock cpu` (one thread only) times the calling thread's CPU time instead of the wall clock:
on a machine whose cores other work shares, the time the thread waited for a core is left out
(what it lost to the others' cache and memory traffic is not). `--cycle-layers` runs each call
on the next layer (as a decode step does), not always layer 3: a small batch's K/V of one layer
then no longer stays in the caches from call to call.

    .venv/bin/python bench/decode_attention_bench.py [--batches 1,32] [--positions 64,300]
        [--threads 1] [--repeats 5] [--layers 30] [--skip-eager] [--clock cpu] [--cycle-layers]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from functools import partial
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results" / "decode_attention.json"
LAYERS, HQ, HKV, D = 30, 9, 3, 64
BLOCK = 16  # the engine's default block size


def eager(qkv, cos, sin, ws, layer, rows, positions):
    """The eager formulas of one layer's decode attention, one sequence at a time: this
    benchmark's baseline and the reference tests/model/test_fused_decode.py checks the op
    against. Writes each new K/V into `ws` as the op does; returns [n, Hq D]."""
    from baton.model.llama import apply_rope

    n = qkv.shape[0]
    qk = apply_rope(qkv[:, :(HQ + HKV) * D].view(n, HQ + HKV, D), cos[:, None], sin[:, None])
    q, k, v = qk[:, :HQ], qk[:, HQ:], qkv[:, (HQ + HKV) * D:].view(n, HKV, D)
    out = []
    for i in range(n):
        r, p = int(rows[i]), int(positions[i])
        ws[layer, 0, r, :, p], ws[layer, 1, r, :, p] = k[i], v[i]
        keys, vals = ws[layer, 0, r, :, :p + 1], ws[layer, 1, r, :, :p + 1]
        scores = q[i].view(HKV, HQ // HKV, D) @ keys.transpose(-1, -2) * D ** -0.5
        out.append((scores.softmax(-1) @ vals).reshape(-1))
    return torch.stack(out)


CLOCK = [time.perf_counter]  # time.thread_time with --clock cpu


def time_us(fn, repeats: int, calls: int) -> list[float]:
    for _ in range(3):
        fn()
    runs = []
    for _ in range(repeats):
        start = CLOCK[0]()
        for _ in range(calls):
            fn()
        runs.append((CLOCK[0]() - start) / calls * 1e6)
    return runs


def cycling(op, layers: int, head: tuple, tail: tuple):
    """`op(*head, layer, *tail)` on layer 1, 2, ..., layers - 1, 0, ... call after call."""
    state = [0]

    def call():
        state[0] = (state[0] + 1) % layers
        return op(*head, state[0], *tail)
    return call


def pool_of(ws: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
            g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A block pool holding what each dense row holds up to its position, in blocks drawn at
    random (block 0 null): (pool, block tables)."""
    layers, n, cap = ws.shape[0], len(rows), ws.shape[4]
    per = -(-cap // BLOCK)
    order = torch.randperm(n * per, generator=g) + 1
    tables = order.view(n, per)
    pool = torch.zeros(n * per + 1, layers, 2, BLOCK, HKV, D)
    for i in range(n):
        span = ws[:, :, int(rows[i]), :, :, :]  # [L, 2, Hkv, cap, D]
        padded = torch.zeros(layers, 2, HKV, per * BLOCK, D)
        padded[:, :, :, :cap] = span
        # [L, 2, Hkv, per, B, D] -> [per, L, 2, B, Hkv, D]
        pool[tables[i]] = padded.view(layers, 2, HKV, per, BLOCK, D).permute(3, 0, 1, 4, 2, 5)
    return pool, tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--positions", default="64,300")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--cycle-layers", action="store_true")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.clock == "cpu":
        if args.threads != 1:
            raise SystemExit("--clock cpu times one thread: use it with --threads 1")
        CLOCK[0] = time.thread_time
    from baton.model.backends import cpu_fused

    if not cpu_fused.AVAILABLE:
        raise SystemExit("baton._decode_ops is not built: run `make install`")
    g = torch.Generator().manual_seed(0)
    rows_out = []
    uptime = os.popen("uptime").read().strip()
    print(f"uptime: {uptime}")
    base = "fused" if args.skip_eager else "eager"
    print(f"{'batch':>5} {'pos':>5} {'path':>6} {'us/call':>9} {'min-max':>17} {'vs ' + base:>8}")
    for n in (int(b) for b in args.batches.split(",")):
        for pos in (int(p) for p in args.positions.split(",")):
            ws = torch.randn(args.layers, 2, n, HKV, pos + 1, D, generator=g)
            qkv = torch.randn(n, (HQ + 2 * HKV) * D, generator=g)
            cos, sin = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)
            rows, positions = torch.arange(n), torch.full((n,), pos)
            pool, tables = pool_of(ws, rows, positions, g)
            calls = max(1, 2000 // (n * max(1, pos // 64)))
            call = (qkv, cos, sin, ws, 3, rows, positions)
            paths = {"eager": partial(eager, *call),
                     "fused": partial(cpu_fused.decode_attention, *call, HQ, HKV),
                     "paged": partial(cpu_fused.decode_attention_paged, qkv, cos, sin, pool, 3,
                                      tables, positions, HQ, HKV)}
            if args.cycle_layers:
                paths["fused"] = cycling(cpu_fused.decode_attention, args.layers,
                                         (qkv, cos, sin, ws), (rows, positions, HQ, HKV))
                paths["paged"] = cycling(cpu_fused.decode_attention_paged, args.layers,
                                         (qkv, cos, sin, pool), (tables, positions, HQ, HKV))
            if args.skip_eager:
                del paths["eager"]
            # Same keys, same arithmetic: the same output bits.
            assert torch.equal(
                cpu_fused.decode_attention_paged(qkv, cos, sin, pool, 3, tables, positions, HQ, HKV),
                cpu_fused.decode_attention(*call, HQ, HKV))
            times = {name: [] for name in paths}
            for _ in range(args.repeats):  # interleaved: load falls on both alike
                for name, fn in paths.items():
                    times[name] += time_us(fn, 1, calls)
            ref = statistics.median(times[base])
            for name, t in times.items():
                med = statistics.median(t)
                rows_out.append({"batch": n, "position": pos, "path": name, "us_per_call": med,
                                 "min": min(t), "max": max(t), "ratio_to_" + base: med / ref})
                print(f"{n:>5} {pos:>5} {name:>6} {med:9.1f} {min(t):8.1f}-{max(t):8.1f} "
                      f"{med / ref:8.2f}")
            del ws, pool
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"threads": args.threads, "layers": args.layers,
                                          "clock": args.clock, "cycle_layers": args.cycle_layers,
                                          "load_avg": os.getloadavg(), "uptime": uptime,
                                          "rows": rows_out}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
