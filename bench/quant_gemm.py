"""The GEMMs of one decode step of the default model (SmolLM2-135M, 30 layers x {qkv, o, gate_up,
down} + the LM head) at each batch, three ways, interleaved in one process so a shared machine's
load falls on all alike:
  fp32      the exact mode's F.linear over float weights (the head: oneDNN, as the backend runs it)
  int4pack  the previous int4 path: torch's _weight_int4pack_mm_for_cpu with bf16 activations
            (bf16 scales), the head in fp32 (oneDNN)
  blocks-P  baton's block kernels (csrc/kernels/qkernels.cpp): Q4_1 layers, Q8_0 head, through
            kernel path P (`--paths`: each path this CPU runs but the scalar one by default;
            avx2 is the previous machine's path, avx512 the multi-row VNNI tiles)
Random weights of the real shapes (the kernels' time does not depend on the values). Prints ms
per step (median, min-max over repeats, ratio to fp32, ms per row) and writes JSON.

    .venv/bin/python bench/quant_gemm.py [--batches 1,8,16] [--repeats 5] [--threads 2]
        [--paths avx2,avx512]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results" / "quant_gemm.json"
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD = (49152, 576)
NUM_LAYERS = 30


def paths(kernel_paths: list[str]) -> dict:
    """name -> [(call(x), k)] for one layer's four GEMMs, and the head's."""
    from baton.model.quant import Blocks, QuantizedWeight

    g = np.random.default_rng(0)
    out: dict = {"fp32": [], "int4pack": [], **{f"blocks-{p}": [] for p in kernel_paths}}
    for n, k in LAYER_SHAPES + [HEAD]:
        w = torch.from_numpy(g.standard_normal((n, k)).astype(np.float32) * 0.05)
        is_head = (n, k) == HEAD
        dense = (lambda x, w=w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")) \
            if is_head else (lambda x, w=w: F.linear(x, w))
        out["fp32"].append((dense, k, is_head))
        if is_head:
            out["int4pack"].append((dense, k, True))
        else:
            q = torch.randint(0, 16, (n, k), dtype=torch.int32)
            packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
            sz = torch.rand(k // 32, n, 2).bfloat16()
            out["int4pack"].append((lambda x, p=packed, s=sz: torch._weight_int4pack_mm_for_cpu(
                x.bfloat16(), p, 32, s).float(), k, False))
        b = Blocks.of_float(w, "Q8_0" if is_head else "Q4_1")
        for p in kernel_paths:  # as the model holds them for that path (avx512: tiled at load)
            qw = QuantizedWeight(b.kind, torch.from_numpy(b.data), w, b.shape, path=p)
            out[f"blocks-{p}"].append((qw.matmul, k, is_head))
    return out


def step_ms(calls, batch: int, xs: dict) -> float:
    start = time.perf_counter()
    for _ in range(3):
        for call, k, is_head in calls:
            for _ in range(1 if is_head else NUM_LAYERS):
                call(xs[k])
    return (time.perf_counter() - start) / 3 * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--paths", default="", help="kernel paths (default: all but scalar)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from baton.model.quant import kernels

    kernel_paths = args.paths.split(",") if args.paths else \
        [p for p in kernels().kernel_paths() if p != "scalar"]
    ways = paths(kernel_paths)
    rows = []
    print(f"{'path':>14} {'batch':>5} {'ms/step':>8} {'min-max':>15} {'vs fp32':>8} {'ms/row':>7}")
    for batch in (int(b) for b in args.batches.split(",")):
        xs = {k: torch.randn(batch, k) for _, k, _ in ways["fp32"]}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for calls in ways.values():
            step_ms(calls, batch, xs)  # warm-up
        for _ in range(args.repeats):
            for name, calls in ways.items():
                times[name].append(step_ms(calls, batch, xs))
        ref = statistics.median(times["fp32"])
        for name, t in times.items():
            med = statistics.median(t)
            rows.append({"path": name, "batch": batch, "ms_per_step": med, "min": min(t),
                         "max": max(t), "ratio_to_fp32": med / ref})
            print(f"{name:>14} {batch:>5} {med:8.2f} {min(t):7.2f}-{max(t):7.2f} {med / ref:8.2f} "
                  f"{med / batch:7.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "kernel_paths": kernel_paths, "load_avg": os.getloadavg(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
