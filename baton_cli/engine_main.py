"""Build and run one engine process from its command-line flags (see baton_cli/engine_args.py).

With `--data-parallel-size N` (NORMAL and PROMPT roles) this process is rank 0 and starts ranks
1..N-1 as child processes; each rank is a whole engine service with its own socket (port + rank)
and registry record, and the ranks' schedulers vote on the step type through a gloo group.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys

from baton.engine import EngineConfig, LLMEngine
from baton.load_cache import default_cache_dir
from baton.ops.cluster_keys import keys_from_args
from baton.ops.cpus import engine_threads, parse_cpus
from baton.ops.dp import DPConfig, DPGroup
from baton.ops.registry import RegistryConfig, make_registry, record_signing_key
from baton.ops.startup import StartupClock
from baton.ops.supervisor import die_with_parent
from baton.protocol import COMPLETION, NORMAL, PROMPT, ROLES
from baton.service.engine_service import EngineService, ServiceConfig
from baton.service.metrics import EngineMetrics
from completion_engine.worker import CompletionWorker
from kv_transfer.config import TransferConfig
from kv_transfer.integrity import FaultPlan
from normal_engine.worker import NormalWorker
from prompt_engine.worker import PromptWorker

logger = logging.getLogger(__name__)


def engine_config(args: argparse.Namespace, role: str) -> EngineConfig:
    return EngineConfig(
        model=args.model or None, dtype=args.dtype, device=args.device or None,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size, num_blocks=args.num_blocks,
        kv_cache_memory_bytes=int(args.kv_cache_gb * 2**30), max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        # Standalone, assume one other engine shares the host (the launcher passes the share).
        num_threads=args.num_threads or engine_threads(2),
        decode_threads=getattr(args, "decode_threads", 0),
        decode_kv=getattr(args, "decode_kv", "pool"),
        **{name: getattr(args, name) for name in CADENCE if hasattr(args, name)},
        # A role change (S41) to prompt keeps the process's flags: a prompt engine drafts
        # nothing, so it leaves them behind.
        **{name: getattr(args, name) for name in SPECULATION
           if hasattr(args, name) and role != PROMPT},
        engine_type=role, load_cache_dir=None if getattr(args, "no_load_cache", False)
        else getattr(args, "load_cache_dir", "") or default_cache_dir(),
        kv_disk_dir=kv_disk_dir(args), kv_disk_bytes=args.kv_disk_bytes)


def kv_disk_dir(args: argparse.Namespace) -> str:
    """--kv-disk-dir as given; a data-parallel rank keeps its blocks in a sub-folder of its own
    (each rank has its own pool)."""
    if not args.kv_disk_dir or getattr(args, "data_parallel_size", 1) <= 1:
        return args.kv_disk_dir
    return os.path.join(args.kv_disk_dir, f"dp{getattr(args, 'data_parallel_rank', 0)}")


# The prefill cadence flags (NORMAL engines only): EngineConfig fields of the same names.
CADENCE = ("prefill_attempt_interval", "prefill_any_attempt_interval", "prefill_min_decode_steps")
# The flags of the engines that decode (speculative decoding, the two-beat pipeline):
# EngineConfig fields of the same names.
SPECULATION = ("speculative", "num_speculative_tokens", "speculative_disable_by_batch_size",
               "async_scheduling")


def transfer_config(args: argparse.Namespace, role: str) -> TransferConfig:
    """The KV side channel's config; `args.cluster_keys` is what main() resolved. An engine
    that changes its role (S41) has only its first role's flags: the others' defaults."""
    if role == PROMPT:
        return TransferConfig(host=args.host,
                              side_channel_port=getattr(args, "side_channel_port", 0),
                              lease_ttl_s=getattr(args, "lease_ttl", 30.0),
                              keys=args.cluster_keys,
                              checksum=getattr(args, "kv_checksum", "all"))
    kv_timeout = getattr(args, "kv_timeout", 30.0)
    return TransferConfig(host=args.host, transfer_timeout_s=kv_timeout,
                          claim_ttl_s=max(60.0, 2 * kv_timeout), keys=args.cluster_keys)


def _normal_worker(engine, args: argparse.Namespace, engine_id: str, metrics):
    return NormalWorker(engine)


def _prompt_worker(engine, args: argparse.Namespace, engine_id: str, metrics):
    return PromptWorker(engine, transfer_config(args, PROMPT), engine_id,
                        advertise_host=args.advertise_host, faults=FaultPlan.from_env())


def _completion_worker(engine, args: argparse.Namespace, engine_id: str, metrics):
    # A mock engine's pulls take the profile's transfer time (its tiny pool moves faster).
    min_pull_s = engine.runner.pull_s if getattr(args, "mock", "") else None
    return CompletionWorker(engine, transfer_config(args, COMPLETION), engine_id,
                            on_pull_result=metrics.on_pull if metrics is not None else None,
                            faults=FaultPlan.from_env(), min_pull_s=min_pull_s)


# The one table of roles: each role's worker (normal_engine/, prompt_engine/, completion_engine/)
# around the same engine core.
ROLE_WORKERS = {NORMAL: _normal_worker, PROMPT: _prompt_worker, COMPLETION: _completion_worker}
assert tuple(ROLE_WORKERS) == ROLES


def build_worker(args: argparse.Namespace, role: str, dp: DPGroup, engine_id: str,
                 metrics: EngineMetrics | None = None, clock: StartupClock | None = None):
    runner = mock_runner(args) if args.mock else None  # None: the model's (torch)
    engine = LLMEngine(engine_config(args, role), all_reduce_min=dp.all_reduce_min,
                       runner=runner, shared_store=shared_store(args))
    load_lora_modules(engine, getattr(args, "lora_modules", []))
    if clock is not None:
        startup = getattr(engine.runner, "startup", {})  # a mock runner has none
        timed = [(k, v) for k, v in startup.items() if isinstance(v, float)]
        clock.mark_split(timed, "engine core")
        if "load cache" in startup:
            clock.notes["weights"] = str(startup["load cache"])
    if getattr(args, "standby", False):
        wait_for_go(args.engine_id)
        if clock is not None:
            clock.mark("standby")
    worker = ROLE_WORKERS[role](engine, args, engine_id, metrics)
    if clock is not None:
        clock.mark("transfer agent" if role != NORMAL else "worker")
    return worker


def shared_store(args: argparse.Namespace):
    """--kv-shared-tier's client (one per process: a role change's engine keeps it), or None."""
    if not getattr(args, "kv_shared_tier", ""):
        return None
    if getattr(args, "_shared_store", None) is None:
        from baton.ops.kv_store import RedisKvStore

        args._shared_store = RedisKvStore(args.kv_shared_tier, args.kv_shared_password_file)
    return args._shared_store


def load_lora_modules(engine: LLMEngine, modules: list[tuple[str, str]]) -> None:
    """--lora-modules: each adapter loaded before the engine serves (ValueError naming the
    adapter that does not load or fit)."""
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names an adapter twice: {names}")
    for name, path in modules:
        engine.load_lora(name, path)


def role_factory(args: argparse.Namespace, engine_id: str, metrics: EngineMetrics | None):
    """A role change's worker (S41): a new engine core in the new mode over the old one's
    runner, so the weights and the KV pool stay; the role's worker around it."""
    def build(role: str, old) -> object:
        engine = LLMEngine(engine_config(args, role), runner=old.engine.runner,
                           shared_store=shared_store(args))
        return ROLE_WORKERS[role](engine, args, engine_id, metrics)
    return build


def wait_for_go(engine_id: str) -> None:
    """A warm spare's pause: until its supervisor writes a line (promoted) or closes the pipe
    (exit). It waits without a timeout by design; it dies with the launcher (PDEATHSIG)."""
    logger.info("%s: warm standby ready, waiting for the go", engine_id)
    if not sys.stdin.readline():
        logger.info("%s: standby's pipe closed; exiting", engine_id)
        raise SystemExit(0)
    logger.info("%s: standby promoted", engine_id)


# Flags that mean something only to a model runner, at their defaults: with --mock one set
# otherwise is refused by name (a mock has no model, no torch threads, no dtype).
MOCK_UNUSED = {"model": "", "dtype": "float32", "quantization": "auto", "device": "",
               "kv_cache_gb": 1.0, "num_threads": 0, "decode_threads": 0, "decode_kv": "pool",
               "kv_cache_dtype": "auto", "lora_modules": [],
               # A mock runner samples no logits: it has nothing to verify drafts with.
               "speculative": "off", "num_speculative_tokens": 0,
               "speculative_disable_by_batch_size": 0}


def mock_runner(args: argparse.Namespace):
    """The mock engine's runner: the profile's step times, a pool of --num-blocks (default the
    profiled engine's) holding a few bytes per token, so KV pulls move real bytes."""
    from baton.perf.mock_runner import MockRunner
    from baton.perf.profile import load

    for name, default in MOCK_UNUSED.items():
        if getattr(args, name, default) != default:
            raise ValueError(f"--{name.replace('_', '-')} has no meaning for a mock engine "
                             f"(--mock): got {getattr(args, name)!r}")
    profile = load(args.mock)  # a ProfileError (a ValueError) names the file and field
    if args.block_size != profile.model.block_size:
        raise ValueError(f"--block-size {args.block_size} differs from the profile's "
                         f"{profile.model.block_size} (--mock {args.mock})")
    return MockRunner(profile, args.num_blocks, kv_pool=True)


def spawn_other_ranks(args: argparse.Namespace, argv: list[str]) -> list[subprocess.Popen]:
    procs = []
    for rank in range(1, args.data_parallel_size):
        extra = ["--data-parallel-rank", str(rank)]
        procs.append(subprocess.Popen([sys.executable, "-m", "baton_cli", *argv, *extra],
                                      preexec_fn=die_with_parent))
    return procs


def install_signal_handlers(service: EngineService, children: list[subprocess.Popen]) -> None:
    """SIGTERM/SIGINT drain this rank and are passed on to the other ranks, which drain too
    (their collectives need every rank until the end)."""
    def handler(signum, _frame) -> None:
        service.stop()
        for proc in children:
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def write_address_file(path: str, address: str) -> None:
    """Write then rename: a reader sees the whole address or no file."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(address + "\n")
    os.replace(tmp, path)


def main(args: argparse.Namespace) -> int:
    clock = StartupClock()
    if not args.mock:
        # The model runtime (torch) too, so that "imports" holds every import and "weights"
        # only the load; a mock engine has no model and loads no torch.
        import baton.model.runner  # noqa: F401
    clock.mark("imports")
    role = args.role
    dp_size = getattr(args, "data_parallel_size", 1)
    rank = getattr(args, "data_parallel_rank", 0)
    children = []
    if dp_size > 1 and getattr(args, "standby", False):
        print("--standby runs one rank (--data-parallel-size 1)", file=sys.stderr)
        return 2
    if dp_size > 1 and rank == 0:
        if not args.port or not args.data_parallel_master_port:
            print("--data-parallel-size > 1 needs --port and --data-parallel-master-port",
                  file=sys.stderr)
            return 2
        children = spawn_other_ranks(args, sys.argv[1:])
    engine_id = args.engine_id if dp_size == 1 else f"{args.engine_id}-dp{rank}"
    port = args.port + rank if args.port else 0
    try:
        args.cluster_keys = keys_from_args(args, f"baton {role} engine {engine_id}")
        if args.cpus:
            # Before torch starts its OpenMP threads: they inherit the mask.
            os.sched_setaffinity(0, parse_cpus(args.cpus))
        dp = DPGroup(DPConfig(rank=rank, size=dp_size, master_addr=args.host,
                              master_port=getattr(args, "data_parallel_master_port", 0)))
        metrics = EngineMetrics(engine_id, role) if args.metrics_port else None
        worker = build_worker(args, role, dp, engine_id, metrics, clock)
        registry = None
        if args.redis_url:
            registry = make_registry(RegistryConfig(
                url=args.redis_url, prefix=args.registry_prefix, ttl_s=args.registry_ttl,
                heartbeat_s=args.registry_ttl / 3, password_file=args.redis_password_file,
                signing_key=record_signing_key(args.cluster_keys)))
        service = EngineService(worker, ServiceConfig(
            engine_id=engine_id, host=args.host, port=port,
            drain_timeout_s=args.drain_timeout, heartbeat_s=args.registry_ttl / 3,
            advertise_host=args.advertise_host, keys=args.cluster_keys), registry=registry,
            dp=dp, metrics=metrics,
            # Data-parallel ranks vote in lockstep: one rank alone cannot change its mode.
            role_factory=role_factory(args, engine_id, metrics) if dp_size == 1 else None)
        if metrics is not None:
            metrics.serve(args.host, args.metrics_port + rank)
    except (ValueError, OSError) as exc:  # model not found, port in use, bad flag values
        print(f"baton {role} engine: {exc}", file=sys.stderr)
        return 1
    service.side_channel = getattr(worker, "side_channel", "")
    install_signal_handlers(service, children)
    if "torch" in sys.modules:  # a model runner was built (a mock engine has none)
        logger.info("torch threads: %d", sys.modules["torch"].get_num_threads())
    def on_ready(ready: EngineService) -> None:
        clock.mark("service")
        clock.log()
        if args.address_file and rank == 0:  # the group's address is rank 0's
            write_address_file(args.address_file, ready.address)

    service.run(on_ready=on_ready)
    dp.close()
    for proc in children:
        proc.wait(timeout=args.drain_timeout + 10)
    return 0
