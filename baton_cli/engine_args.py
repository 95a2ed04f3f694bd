"""`baton engine | prompt-engine | completion-engine | probe`: the engine processes' flags.

One flag set for all three roles (plus a few per role), so deployment manifests and the local
launcher pass the same names everywhere; tests/deploy checks the manifests against this parser.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from baton.engine.config import (
    DEFAULT_KV_DISK_BYTES,
    DEFAULT_SPECULATIVE_TOKENS,
    SERVE_MAX_NUM_BATCHED_TOKENS,
    EngineConfig,
)
from baton.engine.proposers import SPECULATIVE_METHODS
from baton.model.modes import DTYPES, KV_CACHE_DTYPES, QUANTIZATION_REQUESTS
from baton.ops.cluster_keys import add_key_args, keys_from_args
from baton.protocol import COMPLETION, NORMAL, PROMPT, ROLES
from kv_transfer.config import CHECKSUM_MODES
from kv_transfer.integrity import SAMPLE_EVERY

logger = logging.getLogger(__name__)

STARTUP_HELP = """start-up: when it is ready to serve, the engine logs one INFO line with where its
start-up went, each phase from the end of the previous one:
  imports           process start (/proc/self/stat) to the engine's code running
  weights           the model loaded (load cache hit / miss / off / bad: a cache file not used)
  kv pool + runner  the KV pool allocated, the model runner built
  engine core       the scheduler and the engine around the runner
  transfer agent    the role's worker (a prompt or completion engine's NIXL agent)
  service           socket bound, registry record and metrics up
  standby           (--standby only) the wait for the go line, between engine core and the rest
e.g. "start-up 9.3 s: imports 7.8, weights 0.9 (hit), kv pool + runner 0.0, engine core 0.0,
transfer agent 0.5, service 0.2 (since process start, pid 11473)" (a restart at load 9)."""

# engine command -> its role
ROLE_COMMANDS = {"engine": NORMAL, "prompt-engine": PROMPT, "completion-engine": COMPLETION}
COMMAND_OF = {role: command for command, role in ROLE_COMMANDS.items()}


def parse_bytes(text: str) -> int:
    """A size in bytes: an integer, or one with a K, M or G suffix (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    scale = units.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8G, 512M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be > 0, got {text!r}")
    return value


def shared_tier_url(text: str) -> str:
    """--kv-shared-tier: a store's URL an engine can use ("" = off)."""
    from baton.ops.kv_store import check_shared_url

    try:
        return check_shared_url(text) if text else ""
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_common_args(p: argparse.ArgumentParser, role: str) -> None:
    g = p.add_argument_group("service")
    g.add_argument("--engine-id", default=f"{role}-{socket.gethostname()}-{os.getpid()}",
                   help="unique engine name (default: role-hostname-pid)")
    g.add_argument("--host", default="127.0.0.1", help="bind address of the request socket")
    g.add_argument("--port", type=int, default=0, help="request socket port (0 = ephemeral)")
    g.add_argument("--address-file", default="",
                   help="once serving, write the request socket's address here (atomically): "
                        "with --port 0 the parent learns the port the engine bound, with no "
                        "window in which another process takes a port picked in advance")
    g.add_argument("--advertise-host", default="",
                   help="address other hosts use to reach this engine (default: --host)")
    g.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on http://HOST:PORT/metrics (0 = off; with "
                   "data parallelism rank r uses PORT + r)")
    g.add_argument("--redis-url", default=os.environ.get("BATON_REDIS_URL", ""),
                   help="registry; empty = no registry (static configuration)")
    g.add_argument("--redis-password-file", default="",
                   help="file holding the registry's Redis password (default "
                        "$BATON_REDIS_PASSWORD_FILE); the user goes in the URL")
    g.add_argument("--registry-prefix", default="baton")
    g.add_argument("--registry-ttl", type=float, default=3.0, help="seconds a record lives")
    g.add_argument("--drain-timeout", type=float, default=30.0,
                   help="SIGTERM: seconds in-flight work may still run")
    g.add_argument("--num-threads", type=int, default=0,
                   help="torch threads (0 = this engine's share of the cores)")
    if role != PROMPT:  # a prompt engine runs no step without a prompt in it
        g.add_argument("--decode-threads", type=int, default=0,
                       help="torch threads for a step with no prompt in it (0 = auto: "
                            "--num-threads; 1 can be faster on a host whose cores are busy)")
        g.add_argument("--decode-kv", choices=("rows", "pool"), default="pool",
                       help="what the quantized modes' decode attention reads K/V from: the "
                            "block pool itself (pool, the default: the whole KV budget holds "
                            "unique blocks) or a dense copy per decoding sequence beside it "
                            "(rows: half the budget holds the same tokens again). The exact "
                            "mode (--quantization none) keeps rows either way")
    g.add_argument("--standby", action="store_true",
                   help="a warm spare (baton up --warm-standby): import, load the model and build "
                   "the engine, then wait for a line on stdin (EOF: exit) before starting the "
                   "transfer agent, binding the port and registering")
    g.add_argument("--cpus", default="",
                   help="pin the process to these CPUs, e.g. 0 or 2-3 or 0,2 (default: no pinning)")
    add_key_args(p.add_argument_group("cluster keys"))
    m = p.add_argument_group("model and cache")
    m.add_argument("--mock", default="", metavar="PROFILE.json",
                   help="a mock engine: the real engine loop, scheduler and KV transfer over a "
                        "runner that sleeps the profile's predicted step time (baton profile) "
                        "and emits deterministic tokens; no torch, no weights, a tiny KV pool")
    m.add_argument("--model", default="", help="GGUF file or Hugging Face folder (default: SmolLM2)")
    m.add_argument("--dtype", default="float32", choices=DTYPES)
    m.add_argument("--quantization", default="auto", choices=QUANTIZATION_REQUESTS,
                   help="weight-only quantization (CPU kernels for decode steps); auto: int4 "
                        "when the file's layers are Q4 blocks (the default model's are) and the "
                        "dtype is float32 on CPU, else none; the exact mode is --dtype float32 "
                        "--quantization none")
    m.add_argument("--load-cache-dir", default="",
                   help="the load cache: a model's first load in a dtype and quantization writes "
                   "what the loader produced here, later starts map it instead of parsing the "
                   "file (default: $BATON_LOAD_CACHE_DIR, else ~/.cache/baton/load)")
    m.add_argument("--no-load-cache", action="store_true",
                   help="load the model file itself, neither reading nor writing the load cache")
    m.add_argument("--device", default="", help="cpu or cuda (default: cuda when present)")
    m.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    m.add_argument("--num-blocks", type=int, default=0,
                   help="KV blocks in the pool (0 = from --kv-cache-gb)")
    m.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV pool size when --num-blocks 0")
    m.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV pool's element type, independent of --dtype (auto = --dtype); "
                   "bfloat16 holds twice the tokens of float32 in the same --kv-cache-gb and "
                   "halves the bytes a completion engine pulls (README: KV cache dtype)")
    m.add_argument("--lora-modules", nargs="+", default=[], type=lora_module,
                   metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders: adapter_config.json + "
                        "adapter_model.safetensors) to serve beside the base model, each under "
                        "NAME (a request's `model`); more load at run time through the router's "
                        "POST /v1/load_lora_adapter (README: LoRA adapters)")
    m.add_argument("--kv-disk-dir", default="",
                   help="the local disk tier (README: KV tiers): keyed blocks the pool evicts are "
                   "written here, off the step loop, and a later prompt loads them instead of "
                   "recomputing; the files outlive the engine (a restart finds them), so give "
                   "each engine its own folder (baton up uses DIR/ENGINE_ID). Default: off")
    m.add_argument("--kv-disk-bytes", type=parse_bytes, default=DEFAULT_KV_DISK_BYTES,
                   metavar="N[K|M|G]", help="most bytes of files in --kv-disk-dir, the least "
                   f"recently used files deleted first (default {DEFAULT_KV_DISK_BYTES >> 30}G)")
    m.add_argument("--kv-shared-tier", default="", type=shared_tier_url, metavar="URL",
                   help="the shared cluster tier (README: KV tiers): a Redis (redis://USER@HOST:"
                   "PORT/DB, rediss://, unix://) every engine reaches; the full prompt blocks "
                   "this engine computes are published there off the step loop, and a prompt "
                   "whose prefix another engine computed loads it instead of recomputing. Its "
                   "size and eviction are the store's (maxmemory, allkeys-lru); a store that is "
                   "down means recompute, never a failed request. Default: off")
    m.add_argument("--kv-shared-password-file", default="",
                   help="file holding the --kv-shared-tier Redis password (default "
                   "$BATON_REDIS_PASSWORD_FILE); the user goes in the URL")
    m.add_argument("--max-num-seqs", type=int, default=64)
    m.add_argument("--max-num-batched-tokens", type=int, default=SERVE_MAX_NUM_BATCHED_TOKENS)
    m.add_argument("--max-model-len", type=int, default=0, help="0 = the model's context")
    m.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse the KV blocks of cached prompt prefixes "
                   "(on by default; --no-enable-prefix-caching turns it off)")
    if role == NORMAL:  # the only role that chooses between a prompt and a decode step
        c = p.add_argument_group("prefill cadence (docs/scheduler.md S33, S40)")
        c.add_argument("--prefill-attempt-interval", type=int,
                       default=EngineConfig.prefill_attempt_interval,
                       help="an ALL prefill vote every this many decode steps (S33)")
        c.add_argument("--prefill-any-attempt-interval", type=int,
                       default=EngineConfig.prefill_any_attempt_interval,
                       help="an ANY prefill vote every this many decode steps (S33)")
        c.add_argument("--prefill-min-decode-steps", type=int,
                       default=EngineConfig.prefill_min_decode_steps,
                       help="decode steps after a prompt step before the next prefill attempt "
                            "(S40), so running streams advance during a burst of prompts; "
                            "0 = prompt steps back to back while prompts wait")
    if role != PROMPT:  # a prompt engine decodes no token after the first
        sp = p.add_argument_group("speculative decoding (README: Speculative decoding)")
        sp.add_argument("--speculative", default="off", choices=SPECULATIVE_METHODS,
                        help="draft tokens for the model to verify, all of a step in one "
                             "forward: ngram = prompt lookup over each request's own tokens, "
                             "suffix = the continuation of their longest repeated suffix; "
                             "greedy and seeded outputs are those without it")
        sp.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="most drafts per sequence and step (0 = "
                             f"{DEFAULT_SPECULATIVE_TOKENS} with --speculative ngram|suffix; refused "
                             "with --speculative off)")
        sp.add_argument("--speculative-disable-by-batch-size", type=int, default=0,
                        help="0 = a batch drafts only where the engine's measured step times "
                             "say verifying pays (the default); N = a batch of N or more rows "
                             "never drafts, a smaller one always does (vLLM's name)")
        sp.add_argument("--async-scheduling", action="store_true",
                        help="the two-beat pipeline: schedule a plain decode step and build "
                             "its inputs while the step before it runs, and book that one "
                             "meanwhile (README: The two-beat pipeline; off by default)")
    if role in (NORMAL, PROMPT):
        m.add_argument("--data-parallel-size", type=int, default=1,
                       help="ranks, one scheduler each, voting on the step type over gloo")
        m.add_argument("--data-parallel-master-port", type=int, default=0,
                       help="gloo rendezvous port on --host (needed when size > 1)")
        m.add_argument("--data-parallel-rank", type=int, default=0, help=argparse.SUPPRESS)
    if role == PROMPT:
        k = p.add_argument_group("kv transfer")
        k.add_argument("--side-channel-port", type=int, default=0,
                       help="KV side channel port (0 = ephemeral)")
        k.add_argument("--lease-ttl", type=float, default=30.0,
                       help="seconds a prompt's KV waits for its completion engine")
        k.add_argument("--kv-checksum", choices=CHECKSUM_MODES, default="all",
                       help="which handed-off prompts carry a checksum of each KV block, "
                            "verified by the completion engine before it decodes: all, one "
                            f"in {SAMPLE_EVERY} (sample), or none (off)")
    if role == COMPLETION:
        k = p.add_argument_group("kv transfer")
        k.add_argument("--kv-timeout", type=float, default=30.0,
                       help="seconds one KV pull may take before the request fails")


def lora_module(value: str) -> tuple[str, str]:
    """NAME=PATH of --lora-modules -> (name, path)."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (a LoRA adapter's name and its "
                                         f"PEFT folder), got {value!r}")
    return name, path


def add_parser_for(command: str):
    def add_parser(sub: argparse._SubParsersAction) -> None:
        role = ROLE_COMMANDS[command]
        p = sub.add_parser(command, help=f"run a {role} engine", epilog=STARTUP_HELP,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        add_common_args(p, role)
        p.set_defaults(func=run_engine, role=role)
    return add_parser


add_normal_parser = add_parser_for("engine")
add_prompt_parser = add_parser_for("prompt-engine")
add_completion_parser = add_parser_for("completion-engine")


def add_probe_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("probe", help="exit 0 when the engine at ADDRESS answers and is healthy")
    p.add_argument("--address", required=True, help="e.g. tcp://127.0.0.1:7000")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--json", action="store_true",
                   help="print the engine's stats as one JSON object (counters flattened)")
    add_key_args(p)
    p.set_defaults(func=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    from baton.service.client import probe_engine

    try:
        keys = keys_from_args(args, "baton probe")
    except ValueError as exc:
        print(f"baton probe: {exc}", file=sys.stderr)
        return 2
    stats = probe_engine(args.address, args.timeout, keys=keys)
    if stats is None:
        print(f"no answer from {args.address} within {args.timeout}s", file=sys.stderr)
        return 1
    if args.json:
        import json

        import msgspec

        fields = msgspec.structs.asdict(stats)
        print(json.dumps({**{k: v for k, v in fields.items() if k != "extra"}, **stats.extra}))
        return 0 if stats.healthy and not stats.draining else 1
    print(f"{stats.role} {stats.engine_id}: free {stats.num_free_blocks}/{stats.num_total_blocks}"
          f" blocks, running {stats.num_running}, waiting {stats.num_waiting}")
    return 0 if stats.healthy and not stats.draining else 1


def add_role_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("role", help="change a running engine's role without a restart (S41)")
    p.add_argument("--address", required=True, help="the engine, e.g. tcp://127.0.0.1:7000")
    p.add_argument("--to", required=True, choices=ROLES, dest="role", help="the new role")
    p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the change to finish (0: ask and return)")
    add_key_args(p)
    p.set_defaults(func=run_role)


def run_role(args: argparse.Namespace) -> int:
    import time

    from baton.service.client import EngineClient, EngineTimeout

    try:
        keys = keys_from_args(args, "baton role")
    except ValueError as exc:
        print(f"baton role: {exc}", file=sys.stderr)
        return 2
    with EngineClient(args.address, keys=keys) as client:
        try:
            reply = client.change_role(args.role)
            print(f"{args.address}: {reply.message}")
            if not reply.ok:
                return 1
            deadline = time.monotonic() + args.wait
            while args.wait:
                stats = client.stats()
                if stats.role == args.role and not stats.draining:
                    print(f"{args.address}: now {args.role}")
                    return 0
                if time.monotonic() > deadline:
                    print(f"{args.address}: still {stats.role}, draining "
                          f"{stats.num_running + stats.num_waiting} requests", file=sys.stderr)
                    return 1
                time.sleep(0.2)
        except EngineTimeout as exc:
            print(f"baton role: no answer from {args.address}: {exc}", file=sys.stderr)
            return 1
    return 0


def run_engine(args: argparse.Namespace) -> int:
    from baton_cli.engine_main import main as engine_main

    return engine_main(args)
