"""Baton against llama.cpp's server: same GGUF file, same client, same workload, one run.

For each server (llama.cpp's `llama-server` when LLAMA_SERVER points at one, then Baton
co-located and Baton disaggregated 1+1 in each --modes mode, started with `baton up`, which
splits this machine's cores between its engines), it runs serve_bench's fixed workload
(--input-len 256 --output-len 128, greedy, ignore_eos) at each concurrency, with a seed per
concurrency so no prompt repeats on one server (prefix caching must not flatter anyone), and
stops the server. Then a prefill row: llama-bench's pp128/pp1024 (the llama-bench beside
llama-server, when there) against Baton's engine prefilling one prompt in-process with prefix
caching off. Writes bench/results/peer_compare.json and peer_compare.md, ratios against
llama.cpp from the same run.

    LLAMA_SERVER=/path/to/llama-server python bench/peer_compare.py --modes exact,int4
    python bench/peer_compare.py --quick          # a smoke run: ~4 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402 - sibling scripts, not a package
import serve_compare as sc  # noqa: E402

logger = logging.getLogger(__name__)

# mode -> (engine flags after `baton up --`, EngineConfig fields for the in-process prefill row).
# int8 is left out: the engine refuses it on this Q4_1 file (it would round every weight twice).
# bf16 on a CPU without AVX512-BF16 (this AVX2 machine) runs MKL's emulated bf16 GEMMs (oneDNN refuses
# them): it works (an in-process engine generates) but is no fast mode there.
MODES: dict[str, tuple[list[str], dict]] = {
    "exact": (["--quantization", "none"], {}),
    "int4": (["--quantization", "int4"], {"quantization": "int4"}),
    "bf16": (["--dtype", "bfloat16", "--quantization", "none"], {"dtype": "bfloat16"}),
}
LLAMA = "llama.cpp"


@dataclass
class PeerConfig:
    modes: list[str] = field(default_factory=lambda: ["exact"])
    setups: list[str] = field(default_factory=lambda: list(sc.SETUPS))  # Baton's `baton up` setups
    concurrencies: list[int] = field(default_factory=lambda: [1, 8, 32])
    # Per concurrency: c1 at 8 requests is ~8 TPOT samples; c32 at 64 is two full waves.
    num_requests: list[int] = field(default_factory=lambda: [8, 16, 64])
    input_len: int = 256  # words (one token each in SmolLM2's vocabulary)
    output_len: int = 128
    seed: int = 17  # concurrency i uses seed + i
    port: int = 8124
    llama_server: str = ""  # "" = no llama.cpp rows
    llama_args: list[str] = field(default_factory=lambda: ["-t", "2", "-np", "32", "-c", "32768"])
    prefill_lens: list[int] = field(default_factory=lambda: [128, 1024])
    prefill_repeats: int = 3
    threads: int = 2  # llama-bench's -t and the in-process prefill engine's threads
    up_timeout_s: float = 300.0
    results_dir: Path = sb.RESULTS_DIR
    skip_serving: bool = False  # only the prefill row

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown or not self.modes:
            raise ValueError(f"modes must be among {sorted(MODES)}, got {self.modes}")
        if any(s not in sc.SETUPS for s in self.setups):
            raise ValueError(f"setups must be among {sorted(sc.SETUPS)}, got {self.setups}")
        if len(self.num_requests) == 1:
            self.num_requests = self.num_requests * len(self.concurrencies)
        if len(self.num_requests) != len(self.concurrencies):
            raise ValueError(f"one --num-requests per concurrency {self.concurrencies}, "
                             f"got {self.num_requests}")
        if min(self.concurrencies) < 1 or min(self.num_requests) < 1:
            raise ValueError(f"concurrencies and num_requests must be >= 1, got "
                             f"{self.concurrencies} / {self.num_requests}")
        if self.llama_server and not Path(self.llama_server).is_file():
            raise ValueError(f"LLAMA_SERVER {self.llama_server!r} is not a file")


# --------------------------------------------------------------------------- servers
class LlamaServer(sc.BatonUp):
    """llama.cpp's server (binary `llama_server`) as a child process group; BatonUp's
    readiness wait and stop (llamacpp_compare starts it too)."""

    def __init__(self, llama_server: str, model_path: str, args: list[str], port: int,
                 log_path: Path, up_timeout_s: float) -> None:
        argv = [llama_server, "-m", model_path, *args, "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(llama_server).parent)}
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = log_path.open("w")
        logger.info("starting %s (log %s)", " ".join(argv), log_path)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._wait_ready(up_timeout_s)


def start_server(setup: str, mode: str, cfg: PeerConfig, model_path: str) -> sc.BatonUp:
    log = cfg.results_dir / f"peer_compare_{setup}{'_' + mode if mode else ''}.log"
    if setup == LLAMA:
        return LlamaServer(cfg.llama_server, model_path, cfg.llama_args, cfg.port, log,
                           cfg.up_timeout_s)
    up_cfg = sc.CompareConfig(port=cfg.port, up_timeout_s=cfg.up_timeout_s,
                              engine_args=MODES[mode][0], results_dir=cfg.results_dir)
    return sc.BatonUp(setup, up_cfg, log)


def run_levels(setup: str, mode: str, cfg: PeerConfig, model_path: str) -> list[dict]:
    """Every concurrency against one server, started once for all of them."""
    load_before = os.getloadavg()[0]
    server = start_server(setup, mode, cfg, model_path)
    rows = []
    name = f"{setup}_{mode}" if mode else setup
    try:
        for i, (conc, num) in enumerate(zip(cfg.concurrencies, cfg.num_requests, strict=True)):
            bench = sb.BenchConfig(base_url=server.base_url, max_concurrency=conc,
                                   num_requests=num, label=f"{name}_c{conc}",
                                   drain_timeout_s=600.0, progress=False)
            work = sb.WorkloadConfig(dataset="fixed", input_len=cfg.input_len,
                                     output_len=cfg.output_len, seed=cfg.seed + i)
            record = asyncio.run(sb.run_async(bench, work))
            print(sb.format_table(record), flush=True)
            rows.append(level_row(record, setup, mode, conc))
    finally:
        server.stop()
    for row in rows:
        row["load_before"], row["load_after"] = load_before, os.getloadavg()[0]
    return rows


def _q(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(np.asarray(values) * 1e3, q)) if values else float("nan")


def level_row(record: dict, setup: str, mode: str, conc: int) -> dict:
    """One (server, concurrency): throughput, TTFT and TPOT with p10/p50/p90, in ms."""
    s = record["summary"]
    ok = [r for r in record["requests"] if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    tpot = [(r["e2e_s"] - r["ttft_s"]) / (r["output_tokens"] - 1) for r in ok
            if r["output_tokens"] > 1]
    return {"setup": setup, "mode": mode if setup != LLAMA else "Q4_1", "concurrency": conc,
            "num_completed": s["num_completed"], "num_issued": s["num_issued"],
            "errors": s["errors"], "num_short_outputs": s["num_short_outputs"],
            "ignore_eos": s["ignore_eos"], "mean_prompt_tokens":
                s["total_prompt_tokens"] / max(1, s["num_completed"]),
            "cached_token_fraction": s["cached_token_fraction"],
            "out_tok_s": s["output_throughput"], "duration_s": s["duration_s"],
            **{f"ttft_p{q}_ms": _q(ttft, q) for q in (10, 50, 90)},
            **{f"tpot_p{q}_ms": _q(tpot, q) for q in (10, 50, 90)}}


# --------------------------------------------------------------------------- prefill
def llama_bench_prefill(cfg: PeerConfig, model_path: str) -> dict[int, dict]:
    """llama-bench's pp<N> tokens/s (mean and stddev over its repetitions); {} without it."""
    exe = Path(cfg.llama_server).parent / "llama-bench" if cfg.llama_server else None
    if exe is None or not exe.is_file():
        return {}
    argv = [str(exe), "-m", model_path, "-t", str(cfg.threads), "-n", "0", "-o", "json",
            "-r", str(cfg.prefill_repeats), "-p", ",".join(map(str, cfg.prefill_lens))]
    env = {**os.environ, "LD_LIBRARY_PATH": str(exe.parent)}
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, check=True)
    return {int(r["n_prompt"]): {"tok_s": r["avg_ts"], "stddev": r["stddev_ts"]}
            for r in json.loads(out.stdout) if r.get("n_gen", 0) == 0}


def baton_prefill(cfg: PeerConfig, mode: str) -> dict[int, dict]:
    """One prompt per length through Baton's engine in-process, prefix caching off (a repeat
    of the same prompt would otherwise be a cache hit); median, min and max of the repeats."""
    import model_bench as mb

    from baton.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(num_threads=cfg.threads, enable_prefix_caching=False,
                                    **MODES[mode][1]))
    out = {}
    for length in cfg.prefill_lens:
        prompt = mb.make_prompts(engine.tokenizer, 1, length)[0]
        mb.baton_prefill(engine, prompt[:16])  # warm-up
        runs = [mb.baton_prefill(engine, prompt) for _ in range(cfg.prefill_repeats)]
        out[length] = {"tok_s": statistics.median(runs), "min": min(runs), "max": max(runs)}
    return out


# --------------------------------------------------------------------------- tables
def _ratio(a: float, b: float | None) -> str:
    return f"{a / b:.2f}x" if b else "-"


def markdown_table(rows: list[dict], prefill: dict[str, dict[int, dict]]) -> str:
    """Per server and concurrency; ratios against llama.cpp at the same concurrency."""
    ref = {r["concurrency"]: r for r in rows if r["setup"] == LLAMA}
    lines = ["| server | mode | conc | done | out tok/s (vs llama.cpp) | TPOT p50 ms [p10-p90] "
             "(vs) | TTFT p50 ms [p10-p90] (vs) | load |", "|" + "---|" * 8]
    for r in rows:
        b = ref.get(r["concurrency"])
        lines.append(
            f"| {r['setup']} | {r['mode']} | {r['concurrency']} "
            f"| {r['num_completed']}/{r['num_issued']} "
            f"| {r['out_tok_s']:.1f} ({_ratio(r['out_tok_s'], b and b['out_tok_s'])}) "
            f"| {r['tpot_p50_ms']:.1f} [{r['tpot_p10_ms']:.1f}-{r['tpot_p90_ms']:.1f}] "
            f"({_ratio(r['tpot_p50_ms'], b and b['tpot_p50_ms'])}) "
            f"| {r['ttft_p50_ms']:.0f} [{r['ttft_p10_ms']:.0f}-{r['ttft_p90_ms']:.0f}] "
            f"({_ratio(r['ttft_p50_ms'], b and b['ttft_p50_ms'])}) "
            f"| {r['load_before']:.1f}-{r['load_after']:.1f} |")
    if prefill:
        lens = sorted({n for p in prefill.values() for n in p})
        lines += ["", "| prefill tok/s | " + " | ".join(f"{n} tokens" for n in lens) + " |",
                  "|" + "---|" * (len(lens) + 1)]
        ref_p = prefill.get(LLAMA, {})
        for name, p in prefill.items():
            cells = []
            for n in lens:
                x = p.get(n)
                spread = (f" +-{x['stddev']:.0f}" if "stddev" in x else
                          f" [{x['min']:.0f}-{x['max']:.0f}]") if x else ""
                cells.append(f"{x['tok_s']:.0f}{spread} "
                             f"({_ratio(x['tok_s'], ref_p.get(n, {}).get('tok_s'))})"
                             if x else "-")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv: list[str] | None) -> PeerConfig:
    d = PeerConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default=",".join(d.modes),
                   help=f"Baton modes, comma-separated, among {','.join(MODES)}")
    p.add_argument("--setups", default=",".join(d.setups), help="Baton setups to run")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--num-requests", default="8,16,64",
                   help="requests per concurrency (one number, or one per concurrency)")
    p.add_argument("--input-len", type=int, default=d.input_len)
    p.add_argument("--output-len", type=int, default=d.output_len)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--prefill-repeats", type=int, default=d.prefill_repeats)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one request per slot, 32 output tokens, one prefill repeat")
    p.add_argument("--skip-serving", action="store_true", help="only the prefill row")
    p.add_argument("--results-dir", default=str(d.results_dir))
    a = p.parse_args(argv)
    concurrencies = _ints(a.concurrency)
    num_requests = concurrencies if a.quick else _ints(a.num_requests)
    return PeerConfig(modes=[m for m in a.modes.split(",") if m],
                      setups=[s for s in a.setups.split(",") if s],
                      concurrencies=concurrencies, num_requests=num_requests,
                      input_len=a.input_len, output_len=32 if a.quick else a.output_len,
                      seed=a.seed, port=a.port, llama_server=os.environ.get("LLAMA_SERVER", ""),
                      prefill_repeats=1 if a.quick else a.prefill_repeats,
                      results_dir=Path(a.results_dir), skip_serving=a.skip_serving)


def write_results(cfg: PeerConfig, model_path: str, rows: list[dict],
                  prefill: dict[str, dict[int, dict]], t0: float) -> str:
    table = markdown_table(rows, prefill)
    (cfg.results_dir / "peer_compare.md").write_text(table + "\n")
    (cfg.results_dir / "peer_compare.json").write_text(json.dumps(
        {"config": {**cfg.__dict__, "results_dir": str(cfg.results_dir)}, "model": model_path,
         "cpu_count": os.cpu_count(), "wall_s": time.monotonic() - t0, "levels": rows,
         "prefill": prefill}, indent=1))
    return table


def start_main(prog: str, parse: Callable[[list[str] | None], Any],
               argv: list[str] | None) -> tuple[Any, str, float] | None:
    """What a comparison's main() starts with (this one's, llamacpp_compare's): logging, the
    parsed config (None when it is bad: the error is printed, exit 2), the default model's
    path, the config's results folder made, the start time."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = parse(argv)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    from baton.model_files import default_model_path

    model_path = default_model_path()
    cfg.results_dir.mkdir(parents=True, exist_ok=True)
    return cfg, model_path, time.monotonic()


def main(argv: list[str] | None = None) -> int:
    started = start_main("peer_compare", parse_args, argv)
    if started is None:
        return 2
    cfg, model_path, t0 = started
    servers = ([(LLAMA, "")] if cfg.llama_server else []) + \
        [(setup, mode) for mode in cfg.modes for setup in cfg.setups]
    rows: list[dict] = []
    prefill: dict[str, dict[int, dict]] = {}
    for setup, mode in [] if cfg.skip_serving else servers:
        rows += run_levels(setup, mode, cfg, model_path)
        write_results(cfg, model_path, rows, prefill, t0)  # a later failure keeps these
    if cfg.llama_server:
        prefill[LLAMA] = llama_bench_prefill(cfg, model_path)
    prefill = {k: v for k, v in prefill.items() if v}
    for mode in cfg.modes:
        prefill[f"Baton {mode}"] = baton_prefill(cfg, mode)
    table = write_results(cfg, model_path, rows, prefill, t0)
    print(table)
    print(f"wrote {cfg.results_dir / 'peer_compare.json'} and peer_compare.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
