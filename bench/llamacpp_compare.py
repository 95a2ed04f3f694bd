"""Baton's decode against llama.cpp's server, side by side: same GGUF, same cores, one run.

Every server is up for the whole run (this process pins itself to --cores first, so every
server it starts inherits that core set; each gets --threads threads), and each repeat sends
every (workload, server) pair in turn, so a change of the shared machine's load falls on all
of them alike (interleaved; the order flips every repeat). Servers:
  Baton off / ngram / suffix   `baton up --normal-engines 1 --no-cpu-pinning -- --num-threads T
                               [--speculative ngram|suffix]`, the default model's GGUF in the
                               engine's default (int4) mode
  llama.cpp                    `llama-server -m <same GGUF> -t T -tb T --parallel 32 -c 32768`
  llama.cpp <type>             the same with `--spec-type <type>` (each ngram-* type it has)
                               and `--parallel 1 -c 4096`
Workloads (all greedy unless said, ignore_eos, /v1/completions with a text prompt, so no chat
template differs between the servers):
  copy    c1; prompts the answer copies from (a passage to repeat; a function to write out
          again with a name changed): TPOT p50 of every Baton and llama.cpp server
  random  c1; a prompt of random words, sampled at temperature 1 with a seed: nothing to copy;
          Baton off / ngram / suffix
  fixed   serve_bench's fixed 256-word-in / 128-out, no speculation: c1 TPOT p50 and c32
          output tok/s, Baton off against llama.cpp (its --parallel 32 server)
TPOT = (last token's arrival - first's) / (tokens - 1), per request, on the client. First, a
sanity check that both run the same model: each server's greedy first tokens of one prompt.
Writes bench/results/llamacpp_compare.json and .md. State the machine's load with any figure
(the table has it, per workload).

    LLAMA_SERVER=/path/to/llama-server python bench/llamacpp_compare.py --repeats 3
    python bench/llamacpp_compare.py --baton-only     # Baton's rows only (no llama.cpp here)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_compare as pc  # noqa: E402 - sibling scripts, not a package
import serve_bench as sb  # noqa: E402
import serve_compare as sc  # noqa: E402
from spec_decode import PASSAGE  # noqa: E402

logger = logging.getLogger(__name__)

LLAMA_SPEC_TYPES = ["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]
BATON_SPEC = ["ngram", "suffix"]
CODE = '''def moving_average(values, window):
    """The mean of every run of `window` values."""
    total = sum(values[:window])
    averages = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        averages.append(total / window)
    return averages
'''
COPY_PROMPTS = {
    "repeat": "Repeat the following text word for word.\n\nText: " + PASSAGE +
              "\n\nRepeated text: " + PASSAGE[:120],
    "code": "Rewrite this Python function with the variable `total` renamed to `running`, "
            "otherwise unchanged.\n\n" + CODE + "\nRewritten:\n" +
            CODE[:120].replace("total", "running"),
}


@dataclass
class CompareConfig:
    llama_server: str = ""  # the llama-server binary (LLAMA_SERVER); required
    cores: list[int] = field(default_factory=lambda: sorted(os.sched_getaffinity(0)))
    threads: int = 0  # 0 = one per core of `cores`
    repeats: int = 3
    copy_tokens: int = 128  # output tokens of a copy or random request
    fixed_c1_requests: int = 2  # per repeat and server
    c32: int = 32
    spec_types: list[str] = field(default_factory=lambda: list(LLAMA_SPEC_TYPES))
    port: int = 8140  # servers take port, port + 1, ...
    up_timeout_s: float = 300.0
    results_dir: Path = sb.RESULTS_DIR
    baton_only: bool = False  # no llama.cpp server: Baton's rows and targets only

    def __post_init__(self) -> None:
        if not self.baton_only and not Path(self.llama_server or "missing").is_file():
            raise ValueError(f"llama_server {self.llama_server!r} is not a file (set "
                             "LLAMA_SERVER or --llama-server)")
        if not self.cores or not set(self.cores) <= set(os.sched_getaffinity(0)):
            raise ValueError(f"cores {self.cores} must be among this process's "
                             f"{sorted(os.sched_getaffinity(0))}")
        self.threads = self.threads or len(self.cores)
        for name in ("repeats", "copy_tokens", "fixed_c1_requests", "c32", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        unknown = [t for t in self.spec_types if t not in LLAMA_SPEC_TYPES]
        if unknown:
            raise ValueError(f"spec_types {unknown} not among {LLAMA_SPEC_TYPES}")


# --------------------------------------------------------------------------- servers
def server_plan(cfg: CompareConfig) -> dict[str, tuple[str, list[str]]]:
    """name -> (kind, args): `baton up`'s engine args or llama-server's extra args."""
    threads = ["--num-threads", str(cfg.threads)]
    plan = {"Baton off": ("baton", threads)}
    plan.update({f"Baton {m}": ("baton", [*threads, "--speculative", m]) for m in BATON_SPEC})
    if cfg.baton_only:
        return plan
    plan["llama.cpp"] = ("llama", ["--parallel", str(cfg.c32), "-c", str(1024 * cfg.c32)])
    plan.update({f"llama.cpp {t}": ("llama", ["--parallel", "1", "-c", "4096", "--spec-type", t])
                 for t in cfg.spec_types})
    return plan


def start_servers(cfg: CompareConfig, model_path: str) -> dict[str, sc.BatonUp]:
    servers: dict[str, sc.BatonUp] = {}
    try:
        for i, (name, (kind, args)) in enumerate(server_plan(cfg).items()):
            port = cfg.port + i
            log = cfg.results_dir / f"llamacpp_compare_{name.replace(' ', '_')}.log"
            if kind == "llama":
                threads = ["-t", str(cfg.threads), "-tb", str(cfg.threads)]
                servers[name] = pc.LlamaServer(cfg.llama_server, model_path, [*threads, *args],
                                               port, log, cfg.up_timeout_s)
            else:
                up = sc.CompareConfig(port=port, up_timeout_s=cfg.up_timeout_s,
                                      engine_args=args, results_dir=cfg.results_dir)
                servers[name] = sc.BatonUp(name, up, log,
                                           flags=["--normal-engines", "1", "--no-cpu-pinning"])
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict[str, sc.BatonUp]) -> None:
    for server in servers.values():
        server.stop()


# --------------------------------------------------------------------------- one request
def model_name(base_url: str) -> str:
    import httpx

    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def stream(base_url: str, model: str, prompt: str, max_tokens: int, **extra) -> dict:
    """One streamed /v1/completions request: TTFT, TPOT (client clock), tokens, text."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            **extra}
    t0 = time.perf_counter()
    first = last = None
    text, usage, timings = "", {}, {}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings  # llama-server: its drafts' counts
            piece = ((chunk.get("choices") or [{}])[0].get("text")) or ""
            if piece:
                last = time.perf_counter()
                first = first or last
                text += piece
    tokens = int(usage.get("completion_tokens", 0))
    if first is None or tokens < 2:
        raise RuntimeError(f"{base_url}: {tokens} tokens streamed for a {max_tokens}-token ask")
    return {"ttft_s": first - t0, "tpot_s": (last - first) / (tokens - 1), "tokens": tokens,
            "text": text, "draft_n": timings.get("draft_n"),
            "draft_accepted": timings.get("draft_n_accepted")}


def greedy_check(servers: dict[str, sc.BatonUp], models: dict[str, str],
                 num_tokens: int = 16) -> dict:
    """Each server's greedy first tokens of one prompt (not streamed); the words they share
    with Baton off's from the first."""
    import httpx

    prompt = "The capital of France is a city where"
    texts = {}
    for name, server in servers.items():
        body = {"model": models[name], "prompt": prompt, "max_tokens": num_tokens,
                "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        r.raise_for_status()
        texts[name] = r.json()["choices"][0]["text"]
    ref = texts["Baton off"].split()
    shared = {name: next((i for i, (a, b) in enumerate(zip(ref, t.split(), strict=False))
                          if a != b), min(len(ref), len(t.split())))
              for name, t in texts.items()}
    return {"prompt": prompt, "texts": texts, "shared_words": shared, "ref_words": len(ref)}


# --------------------------------------------------------------------------- the workloads
def random_prompt(num_words: int, seed: int) -> str:
    import numpy as np

    words = list(sb.WORDS)
    return " ".join(np.random.default_rng(seed).choice(words, num_words).tolist())


def c1_round(servers, models, names: list[str], prompts: dict[str, str], cfg: CompareConfig,
             sink: dict, **extra) -> None:
    """One request of each prompt on each named server, in that order."""
    for pname, prompt in prompts.items():
        for name in names:
            r = stream(servers[name].base_url, models[name], prompt, cfg.copy_tokens, **extra)
            sink.setdefault((pname, name), []).append(r)


def fixed_round(server: sc.BatonUp, name: str, conc: int, num: int, seed: int) -> dict:
    bench = sb.BenchConfig(base_url=server.base_url, endpoint="completions",
                           max_concurrency=conc, num_requests=num,
                           label=f"{name}_c{conc}", drain_timeout_s=600.0, progress=False)
    work = sb.WorkloadConfig(dataset="fixed", input_len=256, output_len=128, seed=seed)
    return pc.level_row(asyncio.run(sb.run_async(bench, work)), name, "", conc)


def run_rounds(cfg: CompareConfig, servers, models) -> dict:
    """Every repeat: copy, random, fixed c1, fixed c32, each over its servers in turn."""
    copy_names = [n for n in servers]
    baton = [n for n in servers if n.startswith("Baton")]
    fixed = [n for n in ("Baton off", "llama.cpp") if n in servers]
    copy: dict = {}
    rand: dict = {}
    fixed_rows: dict = {}
    loads: dict[str, list[float]] = {}
    for rep in range(cfg.repeats):
        order = (lambda xs: xs) if rep % 2 == 0 else (lambda xs: xs[::-1])
        loads.setdefault("copy", []).append(os.getloadavg()[0])
        c1_round(servers, models, order(copy_names), COPY_PROMPTS, cfg, copy)
        loads.setdefault("random", []).append(os.getloadavg()[0])
        c1_round(servers, models, order(baton), {"random": random_prompt(200, 7)}, cfg, rand,
                 temperature=1.0, seed=11)
        loads.setdefault("fixed", []).append(os.getloadavg()[0])
        for conc, num in ((1, cfg.fixed_c1_requests), (cfg.c32, cfg.c32)):
            for name in order(fixed):
                row = fixed_round(servers[name], name, conc, num, seed=100 * rep + conc)
                fixed_rows.setdefault((name, conc), []).append(row)
        logger.info("repeat %d of %d done (load %.1f)", rep + 1, cfg.repeats, os.getloadavg()[0])
    loads.setdefault("end", []).append(os.getloadavg()[0])
    return {"copy": copy, "random": rand, "fixed": fixed_rows, "loads": loads}


# --------------------------------------------------------------------------- summary
def spread(values: list[float]) -> dict:
    return {"p50": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summarize(raw: dict) -> dict:
    """Medians and spread per (workload, server); the ratios the issue's targets name."""
    def tpot_ms(runs):
        return spread([1e3 * r["tpot_s"] for r in runs])

    copy = {f"{p}|{n}": {**tpot_ms(runs), "draft_n": sum(r["draft_n"] or 0 for r in runs),
                         "draft_accepted": sum(r["draft_accepted"] or 0 for r in runs)}
            for (p, n), runs in raw["copy"].items()}
    rand = {n: tpot_ms(runs) for (_, n), runs in raw["random"].items()}
    fixed = {}
    high = max(conc for _, conc in raw["fixed"])  # --c32
    for (name, conc), rows in raw["fixed"].items():
        fixed[f"{name}|c{conc}"] = {"tpot_p50_ms": spread([r["tpot_p50_ms"] for r in rows]),
                                    "out_tok_s": spread([r["out_tok_s"] for r in rows])}
    # The copy workload's figure per server: the median over every copy request of it.
    per_server: dict[str, list[float]] = {}
    for (_, name), runs in raw["copy"].items():
        per_server.setdefault(name, []).extend(1e3 * r["tpot_s"] for r in runs)
    copy_p50 = {name: statistics.median(v) for name, v in per_server.items()}
    llama_spec = {n: v for n, v in copy_p50.items() if n.startswith("llama.cpp ")}
    best_llama = min(llama_spec, key=llama_spec.get) if llama_spec else "llama.cpp"
    best_baton = min((n for n in copy_p50 if n.startswith("Baton ") and n != "Baton off"),
                     key=copy_p50.get)
    targets = {
        "copy: Baton best spec / Baton off (<= 0.8)":
            copy_p50[best_baton] / copy_p50["Baton off"],
        **{f"random: Baton {m} / off (<= 1.05)": rand[f"Baton {m}"]["p50"] /
           rand["Baton off"]["p50"] for m in BATON_SPEC if f"Baton {m}" in rand}}
    if "llama.cpp" in copy_p50:
        llama_best = min(copy_p50["llama.cpp"], copy_p50.get(best_llama, math.inf))
        targets.update({
            "copy: Baton best spec / llama.cpp best (<= 0.9)": copy_p50[best_baton] / llama_best,
            "fixed c1 TPOT: Baton / llama.cpp (<= 1.0)":
                fixed["Baton off|c1"]["tpot_p50_ms"]["p50"] /
                fixed["llama.cpp|c1"]["tpot_p50_ms"]["p50"],
            f"fixed c{high} tok/s: Baton / llama.cpp (>= 1.5)":
                fixed[f"Baton off|c{high}"]["out_tok_s"]["p50"] /
                fixed[f"llama.cpp|c{high}"]["out_tok_s"]["p50"]})
    return {"copy": copy, "copy_p50_ms": copy_p50, "best_baton_spec": best_baton,
            "best_llama_spec": best_llama, "random": rand, "fixed": fixed, "high": high,
            "targets": targets,
            "loads": raw["loads"]}


def markdown(summary: dict, check: dict) -> str:
    def cell(s: dict) -> str:
        return f"{s['p50']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    loads = summary["loads"]
    lines = ["| workload | server | TPOT p50 ms (min-max) | vs Baton off | drafts kept |",
             "|---|---|---|---|---|"]
    for key, s in summary["copy"].items():
        prompt, name = key.split("|")
        off = summary["copy"][f"{prompt}|Baton off"]["p50"]
        kept = f"{s['draft_accepted']}/{s['draft_n']}" if s["draft_n"] else "-"
        lines.append(f"| copy:{prompt} | {name} | {cell(s)} | {s['p50'] / off:.2f}x | {kept} |")
    for name, s in summary["random"].items():
        lines.append(f"| random (T=1) | {name} | {cell(s)} | "
                     f"{s['p50'] / summary['random']['Baton off']['p50']:.2f}x | - |")
    high = summary["high"]
    lines += ["", f"| fixed 256/128 | server | c1 TPOT p50 ms (min-max) | c{high} out tok/s "
              "(min-max) |", "|---|---|---|---|"]
    for name in [n for n in ("Baton off", "llama.cpp") if f"{n}|c1" in summary["fixed"]]:
        c1, c32 = summary["fixed"][f"{name}|c1"], summary["fixed"][f"{name}|c{high}"]
        lines.append(f"| | {name} | {cell(c1['tpot_p50_ms'])} | {cell(c32['out_tok_s'])} |")
    lines += ["", "| target | measured |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in summary["targets"].items()]
    llama = (f"; best llama.cpp --spec-type: {summary['best_llama_spec']}"
             if "llama.cpp" in summary["copy_p50_ms"] else "")
    lines += ["", f"Best Baton speculation: {summary['best_baton_spec']}{llama}. Load average "
              "(1 min) at the start of "
              f"each repeat's copy part: {', '.join(f'{x:.1f}' for x in loads['copy'])}; at the "
              f"end {loads['end'][0]:.1f}.",
              f"Greedy check ({check['ref_words']} words of Baton off): words shared from the "
              "first: " + ", ".join(f"{n} {k}" for n, k in check["shared_words"].items()) + "."]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> CompareConfig:
    d = CompareConfig.__dataclass_fields__
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", ""))
    p.add_argument("--cores", default="", help="core ids, comma-separated (default: all this "
                                               "process may use)")
    p.add_argument("--threads", type=int, default=0, help="threads per server (0 = one a core)")
    p.add_argument("--repeats", type=int, default=d["repeats"].default)
    p.add_argument("--copy-tokens", type=int, default=d["copy_tokens"].default)
    p.add_argument("--fixed-c1-requests", type=int, default=d["fixed_c1_requests"].default)
    p.add_argument("--c32", type=int, default=d["c32"].default, help="the high concurrency")
    p.add_argument("--spec-types", default=",".join(LLAMA_SPEC_TYPES))
    p.add_argument("--port", type=int, default=d["port"].default)
    p.add_argument("--results-dir", default=str(sb.RESULTS_DIR))
    p.add_argument("--baton-only", action="store_true",
                   help="no llama.cpp server: Baton's rows and the targets without llama.cpp")
    a = p.parse_args(argv)
    cores = [int(c) for c in a.cores.split(",") if c] or sorted(os.sched_getaffinity(0))
    return CompareConfig(llama_server=a.llama_server, cores=cores, threads=a.threads,
                         repeats=a.repeats, copy_tokens=a.copy_tokens,
                         fixed_c1_requests=a.fixed_c1_requests, c32=a.c32,
                         spec_types=[t for t in a.spec_types.split(",") if t], port=a.port,
                         results_dir=Path(a.results_dir), baton_only=a.baton_only)


def main(argv: list[str] | None = None) -> int:
    started = pc.start_main("llamacpp_compare", parse_args, argv)
    if started is None:
        return 2
    cfg, model_path, t0 = started
    os.sched_setaffinity(0, cfg.cores)  # every server started below inherits the core set
    load_start = os.getloadavg()
    servers = start_servers(cfg, model_path)
    try:
        models = {name: model_name(s.base_url) for name, s in servers.items()}
        check = greedy_check(servers, models)
        raw = run_rounds(cfg, servers, models)
    finally:
        stop_servers(servers)
    name = "llamacpp_compare_baton_only" if cfg.baton_only else "llamacpp_compare"
    raw_record = {part: {"|".join(map(str, k)): v for k, v in raw[part].items()}
                  for part in ("copy", "random", "fixed")}
    (cfg.results_dir / f"{name}_raw.json").write_text(json.dumps(raw_record))  # if what follows fails
    summary = summarize(raw)
    table = markdown(summary, check)
    record = {"config": {**cfg.__dict__, "llama_server": Path(cfg.llama_server).name,
                         "results_dir": str(cfg.results_dir.name)},
              "model": Path(model_path).name, "servers": {n: a for n, (_, a) in
                                                          server_plan(cfg).items()},
              "cpu_count": os.cpu_count(), "load_start": load_start,
              "load_end": os.getloadavg(), "wall_s": time.monotonic() - t0,
              "greedy_check": check, "summary": summary,
              "raw": raw_record}
    (cfg.results_dir / f"{name}.json").write_text(json.dumps(record, indent=1))
    (cfg.results_dir / f"{name}_raw.json").unlink()
    (cfg.results_dir / f"{name}.md").write_text(table + "\n")
    print(table)
    print(f"wall {time.monotonic() - t0:.0f} s; wrote {cfg.results_dir / name}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
