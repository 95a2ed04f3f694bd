"""`baton up --planner apply` on 8 mock engines under a workload that shifts half-way from
decode-heavy chat to prefill-heavy retrieval (issue 27's live check): the planner moves engines
between the prompt and completion roles in place (S41) while the load runs; every request must
succeed, and every pool be whole (no owned block, no lease, no pull) at the end.

    .venv/bin/python bench/live_planner.py [--phase-s 90] [--concurrency 6]

Mock engines (`--mock tests/data/profile_test.json`): the real router, schedulers, ZMQ, registry
and NIXL, with the profile's step times (docs/profile.md). Phase 1: chat, prompts of ~60 words,
64 output tokens; phase 2: retrieval, prompts of ~700 words, 4 output tokens; each at a fixed
concurrency. Every second the engines' roles are probed. Prints the role changes and the
request counts, writes bench/results/live_planner.json and a PNG of the roles over time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from baton_up import start_baton_up  # noqa: E402 - a sibling script

from baton.protocol import COMPLETION, PROMPT  # noqa: E402
from baton.service.client import is_whole, probe_engine  # noqa: E402
from baton.workload.words import WORDS  # noqa: E402
from kv_transfer.auth import generate  # noqa: E402

PROFILE = HERE.parent / "tests" / "data" / "profile_test.json"
ENGINE_FLAGS = ["--num-blocks", "96", "--max-num-seqs", "8"]
MODEL = "SmolLM2-135M-Instruct"
PHASES = (("chat", 60, 64), ("retrieval", 700, 4))  # name, prompt words, max_tokens


def _request(base_url: str, i: int, words: int, max_tokens: int) -> int:
    prompt = " ".join(WORDS[(i * 13 + j) % len(WORDS)] for j in range(words))
    try:
        resp = httpx.post(f"{base_url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        return resp.status_code
    except httpx.HTTPError:
        return -1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase-s", type=float, default=90.0, help="seconds of each phase")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--prompt-engines", type=int, default=4, help="the starting split")
    p.add_argument("--completion-engines", type=int, default=4)
    p.add_argument("--out", default=str(HERE / "results" / "live_planner.json"))
    args = p.parse_args(argv)

    key_dir = str(generate())  # the cluster keys, ours too: the engines are probed
    baton = start_baton_up(args.prompt_engines, args.completion_engines, ENGINE_FLAGS, [
        "--mock", str(PROFILE), "--no-cpu-pinning", "--planner", "apply",
        "--planner-profile", str(PROFILE), "--goodput", "ttft:1500", "tpot:200",
        "--planner-interval", "3", "--planner-window", "20", "--planner-cooldown", "20"],
        key_dir)
    t0 = time.monotonic()
    roles_over_time: list[dict] = []
    statuses: dict[str, list[int]] = {name: [] for name, _, _ in PHASES}
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):
            roles = {}
            for engine, address in baton.engines.items():
                stats = probe_engine(address, 2.0, baton.keys)
                roles[engine] = stats.role if stats is not None else "?"
            roles_over_time.append({"t": round(time.monotonic() - t0, 1), "roles": roles,
                                    "prompt": sum(r == PROMPT for r in roles.values()),
                                    "completion": sum(r == COMPLETION for r in roles.values())})

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    whole = False
    try:
        for name, words, max_tokens in PHASES:
            phase_end = time.monotonic() + args.phase_s
            print(f"[{time.monotonic() - t0:6.1f} s] phase {name}: {words}-word prompts, "
                  f"{max_tokens} tokens, concurrency {args.concurrency}", flush=True)

            def worker(k: int, name=name, words=words, max_tokens=max_tokens,
                       phase_end=phase_end) -> None:
                i = k
                while time.monotonic() < phase_end:
                    statuses[name].append(_request(baton.base_url, i, words, max_tokens))
                    i += args.concurrency

            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(worker, range(args.concurrency)))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            stats = [probe_engine(a, 5.0, baton.keys) for a in baton.engines.values()]
            if all(s is not None and is_whole(s) for s in stats):
                whole = True
                break
            time.sleep(0.5)
        plan = httpx.get(f"{baton.base_url}/planner", timeout=10).json()
    finally:
        stop.set()
        watcher.join(5)
        changes = [m.group(0) for m in baton.stderr.matching(r"planner (change|advise): .*")]
        baton.stop()
        shutil.rmtree(key_dir, ignore_errors=True)

    splits = []
    for sample in roles_over_time:
        if not splits or splits[-1][1] != sample["prompt"]:
            splits.append((sample["t"], sample["prompt"]))
    total = len(baton.engines)
    print("\nsplit over time (prompt:completion):", ", ".join(
        f"{t:.0f} s {n}P:{total - n}D" for t, n in splits))
    for line in changes:
        print(" ", line)
    failed = {name: sum(s != 200 for s in got) for name, got in statuses.items()}
    for name, got in statuses.items():
        print(f"{name:10s} requests {len(got):4d}  failed {failed[name]}")
    print(f"every pool whole at the end: {whole}")
    record = {"phase_s": args.phase_s, "concurrency": args.concurrency,
              "start": f"{args.prompt_engines}P:{args.completion_engines}D",
              "profile": "tests/data/profile_test.json", "slos_ms": {"ttft": 1500, "tpot": 200},
              "requests": {n: len(g) for n, g in statuses.items()}, "failed": failed,
              "pools_whole": whole, "planner_log": changes, "last_plan": plan,
              "splits": splits, "roles_over_time": roles_over_time}
    out = Path(args.out)
    out.write_text(json.dumps(record, indent=1))
    _plot(roles_over_time, total, args.phase_s, out.with_suffix(".png"))
    print(f"wrote {out}")
    return 0 if whole and not any(failed.values()) and len(splits) > 1 else 1


def _plot(samples: list[dict], total: int, phase_s: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from planner_sim import plot_roles

    fig, ax = plt.subplots(figsize=(7, 3))
    plot_roles(ax, samples, phase_s, "chat -> retrieval")
    ax.set_xlabel("seconds")
    ax.set_ylabel("engines")
    ax.set_ylim(0, total)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
