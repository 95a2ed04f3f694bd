"""`baton up`: start Redis, the engines and the router on this host, and stop them together.

Every child is a separate process (`python -m baton_cli ROLE ...`) that dies with the launcher
(PR_SET_PDEATHSIG), so a launcher killed at 3 a.m. leaves no orphan holding a port or a pool.
Start-up waits for each engine to answer a stats request and for the router's /health; any
child that exits or a wait that times out during start-up stops everything with one clear
message. Once up, a child that exits is restarted (baton/ops/supervisor.py: same engine id and
port, backoff, a limit) while the others keep serving; SIGTERM or Ctrl-C stops them all.

Every internal wire is CURVE-authenticated: unless given `--cluster-key-dir`, the launcher
generates the cluster's keys at start into a private temp dir (0700, files 0600) that every
child gets with `--cluster-key-dir` and that is removed at stop. `--insecure` (benchmarks)
passes `--insecure` to every child instead.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field

from baton.model.modes import KV_CACHE_DTYPES, check_kv_cache_dtype
from baton.ops.cluster_keys import INSECURE_WARNING, add_key_args
from baton.ops.cpus import cpu_shares, engine_threads
from baton.ops.redis_server import RedisServer, RedisStartError, free_port, port_is_free
from baton.ops.supervisor import Child, LaunchError, RestartPolicy, Supervisor
from baton.protocol import COMPLETION, NORMAL, PROMPT, ROLES
from baton.workload.results import parse_slos
from baton_cli.engine_args import (
    COMMAND_OF,
    ROLE_COMMANDS,
    add_common_args,
    lora_module,
    parse_bytes,
)
from kv_transfer.auth import ENV_KEY_DIR, ClusterKeys, generate

logger = logging.getLogger(__name__)


LOCAL_STORE = "local"  # --kv-shared-tier local[:SIZE]: baton up starts the store
DEFAULT_KV_SHARED_BYTES = 1 << 30


@dataclass
class LaunchConfig:
    host: str = "127.0.0.1"
    router_port: int = 8000
    num_prompt_engines: int = 1
    num_completion_engines: int = 1
    # Co-located engines; beside prompt + completion engines a mixed fleet, where the router
    # chooses each request's path (router/path.py).
    num_normal_engines: int = 0
    model: str = ""  # "" = the default model
    redis_url: str = ""  # "" = start a local redis-server (closed: a generated password)
    redis_password_file: str = ""  # the password of an external redis_url
    api_key: str = ""
    # Named API keys for the router (router/api_keys.py): each its own rate limit and usage
    # counters; with cache_salt_per_key each key's requests share a prefix cache only among
    # themselves. Checked here, so a bad file fails `baton up` before anything starts.
    api_keys_file: str = ""
    cache_salt_per_key: bool = False
    _launcher_key: str = field(default="", init=False, repr=False)  # one of api_keys_file's
    # The planner (planner/core.py, baton_cli/live_planner.py): off, advise or apply, over a
    # prompt/completion fleet, with the profile it predicts with and the SLOs it serves.
    planner: str = "off"
    planner_profile: str = ""
    slos_ms: dict[str, float] = field(default_factory=dict)
    planner_interval_s: float = 30.0
    planner_window_s: float = 120.0
    planner_cooldown_s: float = 300.0
    ready_timeout_s: float = 300.0
    # Flags after `--`, passed to every engine whose role has them (role_engine_args).
    engine_args: list[str] = field(default_factory=list)
    pin_cpus: bool = True  # give each engine its own cores (see cpu_shares)
    metrics: bool = True  # each engine serves Prometheus metrics on a free port (the banner)
    restart: RestartPolicy = field(default_factory=RestartPolicy)  # once up, for every child
    routing: str = "cache-aware"  # the router's --routing (router/engine_pool.py)
    # A mixed fleet's path choice, the router's flags of the same names (router/path.py):
    profile: str = ""  # --profile: predict each path's cost from this [sim] profile
    pd_threshold_tokens: int | None = None  # --pd-threshold-tokens: a static rule instead
    pd_handoff_ms: float | None = None  # --pd-handoff-ms (with profile); None = the router's
    cluster_key_dir: str = ""  # "" = generate the cluster's keys into a private temp dir
    insecure: bool = False  # no CURVE on the internal wires (benchmarks only)
    mock: str = ""  # a profile: every engine a mock engine (--mock), the router unchanged
    # Keep a warm spare of each engine (`--standby`: imported, model loaded, waiting), promoted
    # when the engine exits: a restart then costs the NIXL agent and the socket. Each spare
    # costs a process; its weights are the load cache's pages, shared with the engine.
    warm_standby: bool = False
    # Every engine's --kv-cache-dtype: a prompt and a completion engine of different KV dtypes
    # cannot exchange blocks, so the fleet gets one (auto = the engines' --dtype).
    kv_cache_dtype: str = "auto"
    # Every engine's --lora-modules (NAME=PATH each): the prompt and the completion engine of a
    # request must both serve its adapter, so the fleet gets one list.
    lora_modules: list[str] = field(default_factory=list)
    # The local disk tier (README: KV tiers): each engine keeps its evicted blocks in
    # kv_disk_dir/ENGINE_ID (a restarted engine has the same id: it finds its own files), at
    # most kv_disk_bytes each (0 = the engines' default); "" = off.
    kv_disk_dir: str = ""
    kv_disk_bytes: int = 0
    # The shared cluster tier (README: KV tiers), handed to every engine: "local[:SIZE]" starts
    # a Redis for it here (at most SIZE, default 1G, least recently used keys evicted; closed
    # like the registry's), a redis:// URL is one that runs (its password in
    # kv_shared_password_file); "" = off.
    kv_shared_tier: str = ""
    kv_shared_password_file: str = ""

    @property
    def kv_shared_local_bytes(self) -> int:
        """The maxmemory of the store `local[:SIZE]` asks to start (0: none to start)."""
        if self.kv_shared_tier.split(":")[0] != LOCAL_STORE:
            return 0
        size = self.kv_shared_tier.removeprefix(LOCAL_STORE).removeprefix(":")
        return parse_bytes(size) if size else DEFAULT_KV_SHARED_BYTES

    def _check_shared_tier(self) -> None:
        for flag in ("--kv-shared-tier", "--kv-shared-password-file"):
            if any(a.split("=")[0] == flag for a in self.engine_args):
                raise ValueError(f"give {flag} to `baton up` itself, not after --: every "
                                 "engine must share the one store")
        if not self.kv_shared_tier:
            if self.kv_shared_password_file:
                raise ValueError("--kv-shared-password-file is for --kv-shared-tier URL")
            return
        if self.kv_shared_tier.split(":")[0] == LOCAL_STORE:
            if self.kv_shared_password_file:
                raise ValueError("--kv-shared-password-file is for an external --kv-shared-tier "
                                 "URL; the local store makes its own password")
            try:
                self.kv_shared_local_bytes  # noqa: B018 (parses SIZE)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"--kv-shared-tier {self.kv_shared_tier!r}: {e}") from None
            return
        from baton.ops.kv_store import check_shared_url

        check_shared_url(self.kv_shared_tier)

    def __post_init__(self) -> None:
        self.kv_cache_dtype = check_kv_cache_dtype(self.kv_cache_dtype)
        for name in ("num_prompt_engines", "num_completion_engines", "num_normal_engines"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        disagg = self.num_prompt_engines + self.num_completion_engines
        if self.num_normal_engines == 0 and (self.num_prompt_engines == 0
                                             or self.num_completion_engines == 0):
            raise ValueError("need at least one prompt and one completion engine, "
                             f"or a normal engine (got {self.num_prompt_engines} prompt, "
                             f"{self.num_completion_engines} completion)")
        if self.num_normal_engines and disagg and not (self.num_prompt_engines
                                                       and self.num_completion_engines):
            raise ValueError(
                "a mixed fleet needs both --prompt-engines and --completion-engines beside "
                f"--normal-engines (got {self.num_prompt_engines} prompt, "
                f"{self.num_completion_engines} completion): a prompt engine hands its KV "
                "to a completion engine")
        if self.pd_threshold_tokens is not None and self.pd_threshold_tokens < 0:
            raise ValueError(f"--pd-threshold-tokens must be >= 0, got {self.pd_threshold_tokens}")
        if self.profile and self.pd_threshold_tokens is not None:
            raise ValueError("give either --profile or --pd-threshold-tokens, not both")
        if self.pd_handoff_ms is not None and not self.profile:
            raise ValueError("--pd-handoff-ms prices the disaggregated path for --profile's "
                             "predictions; it needs --profile")
        if self.pd_handoff_ms is not None and not 0 <= self.pd_handoff_ms < float("inf"):
            raise ValueError(f"--pd-handoff-ms must be >= 0 and finite, got {self.pd_handoff_ms}")
        if self.profile:
            from baton.perf.profile import load

            load(self.profile)  # ProfileError (a ValueError) naming the file and its bad field
        role_engine_args(self.engine_args, NORMAL)  # an unknown flag fails here, not at start
        if self.redis_password_file and not self.redis_url:
            raise ValueError("--redis-password-file is for an external --redis-url; the "
                             "embedded Redis makes its own password")
        if self.insecure and self.cluster_key_dir:
            raise ValueError("--insecure and --cluster-key-dir contradict each other")
        if self.mock and self.model:
            raise ValueError("--mock engines have no model: drop --model (the router "
                             "tokenizes with the default model's tokenizer)")
        if "--mock" in self.engine_args:
            raise ValueError("give --mock to `baton up` itself, not after --")
        if self.mock and self.kv_cache_dtype != "auto":
            raise ValueError("--mock engines have no KV dtype: drop --kv-cache-dtype")
        if self.mock and self.lora_modules:
            raise ValueError("--mock engines have no model to adapt: drop --lora-modules")
        for module in self.lora_modules:
            try:
                lora_module(module)
            except argparse.ArgumentTypeError as e:
                raise ValueError(f"--lora-modules: {e}") from None
        if "--lora-modules" in self.engine_args:
            raise ValueError("give --lora-modules to `baton up` itself, not after --: every "
                             "engine must serve the same adapters")
        if any(a.split("=")[0] == "--kv-cache-dtype" for a in self.engine_args):
            raise ValueError("give --kv-cache-dtype to `baton up` itself, not after --: "
                             "prompt and completion engines must share it")
        for flag in ("--kv-disk-dir", "--kv-disk-bytes"):
            if any(a.split("=")[0] == flag for a in self.engine_args):
                raise ValueError(f"give {flag} to `baton up` itself, not after --: each "
                                 "engine gets its own sub-folder of the directory")
        if self.kv_disk_bytes < 0:
            raise ValueError(f"--kv-disk-bytes must be > 0, got {self.kv_disk_bytes}")
        if self.kv_disk_bytes and not self.kv_disk_dir:
            raise ValueError("--kv-disk-bytes sizes the disk tier: give --kv-disk-dir too")
        self._check_shared_tier()
        if self.api_keys_file:
            from router.api_keys import load_api_keys

            self._launcher_key = load_api_keys(self.api_keys_file)[0].key
        if self.planner not in ("off", "advise", "apply"):
            raise ValueError(f"--planner must be off, advise or apply, got {self.planner!r}")
        if self.planner != "off":
            if self.num_normal_engines:
                raise ValueError("--planner moves engines between prompt and completion: "
                                 "run prompt and completion engines, no --normal-engines")
            if not self.planner_profile or not self.slos_ms:
                raise ValueError("--planner needs a profile (--planner-profile or --profile: "
                                 "its predictions) and --goodput ttft:MS tpot:MS (what it "
                                 "serves)")
            from baton.perf.profile import load as load_profile

            load_profile(self.planner_profile)  # a bad profile fails here, naming its field
        if self.cache_salt_per_key and not (self.api_key or self.api_keys_file):
            raise ValueError("--cache-salt-per-key needs API keys (--api-key or --api-keys-file)")
        for flag in ("--cluster-key-dir", "--insecure"):
            if flag in self.engine_args:
                raise ValueError(f"give {flag} to `baton up` itself, not after --: the router "
                                 "and every engine must share it")


    def launcher_key(self) -> str:
        """A key the launcher itself may use to ask the router (the banner's model name)."""
        return self.api_key or self._launcher_key


def role_engine_args(engine_args: list[str], role: str) -> list[str]:
    """`engine_args` less the flags `role`'s engine does not have but another role's does
    (`--lease-ttl` reaches prompt engines only, `--kv-timeout` completion engines only).

    Without this one role-specific flag made the other role's engines exit at start-up. A
    flag (or value) no role accepts is a ValueError naming it.
    """
    def unknown_to(r: str) -> list[str]:
        parser = argparse.ArgumentParser(prog=f"baton {r} engine", add_help=False)
        add_common_args(parser, r)
        return parser.parse_known_args(engine_args)[1]

    unknown = unknown_to(role)
    if not unknown:
        return list(engine_args)
    elsewhere = [r for r in ROLES if r != role]
    nobody = [a for a in unknown if all(a in unknown_to(r) for r in elsewhere)]
    if nobody:
        raise ValueError(f"no engine takes the engine flag(s) {' '.join(nobody)} "
                         "(see baton prompt-engine --help, baton completion-engine --help)")
    # The parser keeps the unknown tokens in order: drop them as a subsequence.
    kept, j = [], 0
    for arg in engine_args:
        if j < len(unknown) and arg == unknown[j]:
            j += 1
        else:
            kept.append(arg)
    return kept


def _engine_answers(address: str, keys: ClusterKeys | None) -> bool:
    from baton.service.client import probe_engine

    return probe_engine(address, timeout_s=0.2, keys=keys) is not None


def _http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=0.5) as resp:
            return resp.status == 200
    except OSError:
        return False


def wait_engines_ready(children: list[Child], addresses: dict[str, str], deadline: float,
                       ready_s: dict[str, float], spawned_at: dict[str, float],
                       keys: ClusterKeys | None = None,
                       address_files: dict[str, str] | None = None) -> None:
    """Probe every engine until each answers, all together, so each one's time-to-ready
    (`ready_s`, seconds from its spawn) is its own and not the slowest one's before it. An
    engine started with --port 0 is probed once its address file names the port it bound;
    its command line then names that port, so a restart binds it again."""
    from baton.service.client import probe_engine

    waiting = [c for c in children if c.name in addresses]
    while waiting:
        if time.monotonic() >= deadline:
            raise LaunchError(f"{', '.join(c.name for c in waiting)} not ready in time")
        for child in list(waiting):
            child.check_alive()
            if not addresses[child.name]:
                address = _read_address((address_files or {}).get(child.name, ""))
                if not address:
                    continue
                addresses[child.name] = address
                child.pin_port(address.rsplit(":", 1)[1])
            if probe_engine(addresses[child.name], timeout_s=0.5, keys=keys) is not None:
                ready_s[child.name] = time.monotonic() - spawned_at[child.name]
                logger.info("%s ready in %.1f s", child.name, ready_s[child.name])
                waiting.remove(child)


def _read_address(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def wait_http_ready(url: str, deadline: float, child: Child) -> None:
    import urllib.request

    while time.monotonic() < deadline:
        child.check_alive()
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise LaunchError(f"{child.name} at {url} not ready in time")


class Launcher:
    def __init__(self, config: LaunchConfig):
        self.config = config
        self.children: list[Child] = []
        self.redis: RedisServer | None = None
        self.redis_url = config.redis_url
        self.redis_args: list[str] = (["--redis-password-file", config.redis_password_file]
                                      if config.redis_password_file else [])
        self.kv_redis: RedisServer | None = None  # --kv-shared-tier local: the tier's store
        self.shared_args: list[str] = []  # every engine's --kv-shared-tier flags
        self.engine_addresses: dict[str, str] = {}
        self.address_files: dict[str, str] = {}  # engine id -> its --address-file
        self.engine_roles: dict[str, str] = {}  # engine id -> its role now (S41 may change it)
        self.planner = None  # baton_cli/live_planner.py, with --planner advise|apply
        self.metrics_urls: dict[str, str] = {}  # engine id -> its Prometheus endpoint
        self.spawned_at: dict[str, float] = {}  # child -> time.monotonic() of its spawn
        self.ready_s: dict[str, float] = {}  # child -> seconds from its spawn to ready
        self._stopping = False
        self.supervisor: Supervisor | None = None
        self.keys: ClusterKeys | None = None
        self.key_args: list[str] = []
        self._own_key_dir = ""  # generated here: removed at stop
        # Each engine's --address-file: engines bind an ephemeral port on their first start and
        # report it (a port picked here in advance could be taken, before the engine bound it,
        # by another engine's ephemeral KV side channel); restarts then bind that same port.
        self._run_dir = tempfile.mkdtemp(prefix="baton-up-")

    def _setup_keys(self) -> list[str]:
        """The children's key flags; generates the keys unless given a dir or --insecure."""
        cfg = self.config
        if cfg.insecure:
            logger.warning(INSECURE_WARNING, "baton up")
            return ["--insecure"]
        key_dir = cfg.cluster_key_dir
        if not key_dir:
            key_dir = self._own_key_dir = str(generate())
            logger.info("cluster keys generated in %s (removed at stop)", key_dir)
        try:
            self.keys = ClusterKeys.load(key_dir)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        if not (self.keys.can_serve and self.keys.can_dial):
            raise LaunchError(f"{key_dir} must hold both secrets on one host")
        return ["--cluster-key-dir", key_dir]

    def start(self) -> None:
        cfg = self.config
        self.key_args = self._setup_keys()
        if not port_is_free(cfg.host, cfg.router_port):
            raise LaunchError(f"router port {cfg.host}:{cfg.router_port} is already in use "
                              "(pass --port to choose another)")
        if not self.redis_url:
            self.redis = RedisServer(cfg.host).start()
            self.redis_url = self.redis.url
            self.redis_args = ["--redis-password-file", self.redis.password_file]
        self.shared_args = self._start_shared_tier()
        deadline = time.monotonic() + cfg.ready_timeout_s
        roles = ([(COMMAND_OF[NORMAL], NORMAL)] * cfg.num_normal_engines
                 + [(COMMAND_OF[PROMPT], PROMPT)] * cfg.num_prompt_engines
                 + [(COMMAND_OF[COMPLETION], COMPLETION)] * cfg.num_completion_engines)
        threads = engine_threads(len(roles))
        pinned = cfg.pin_cpus and "--cpus" not in cfg.engine_args
        shares = cpu_shares(len(roles), threads) if pinned else []
        counts: dict[str, int] = {}
        for i, (command, role) in enumerate(roles):
            idx = counts[role] = counts.get(role, -1) + 1
            self._start_engine(command, f"{role}-{idx}", threads, shares[i] if shares else "")
        wait_engines_ready(self.children, self.engine_addresses, deadline, self.ready_s,
                           self.spawned_at, self.keys, self.address_files)
        self._start_router(deadline)

    def _start_shared_tier(self) -> list[str]:
        cfg = self.config
        if not cfg.kv_shared_tier:
            return []
        if cfg.kv_shared_local_bytes:
            self.kv_redis = RedisServer(cfg.host, maxmemory_bytes=cfg.kv_shared_local_bytes).start()
            logger.info("KV shared tier: redis-server on %s, maxmemory %d MiB, allkeys-lru",
                        self.kv_redis.url, cfg.kv_shared_local_bytes >> 20)
            return ["--kv-shared-tier", self.kv_redis.url,
                    "--kv-shared-password-file", self.kv_redis.password_file]
        return ["--kv-shared-tier", cfg.kv_shared_tier,
                *(["--kv-shared-password-file", cfg.kv_shared_password_file]
                  if cfg.kv_shared_password_file else [])]

    def _disk_args(self, engine_id: str) -> list[str]:
        cfg = self.config
        if not cfg.kv_disk_dir:
            return []
        return ["--kv-disk-dir", os.path.join(cfg.kv_disk_dir, engine_id),
                *(["--kv-disk-bytes", str(cfg.kv_disk_bytes)] if cfg.kv_disk_bytes else [])]

    def _model_args(self) -> list[str]:
        return ["--model", self.config.model] if self.config.model else []

    def _start_engine(self, command: str, engine_id: str, threads: int, cpus: str) -> None:
        cfg = self.config
        address_file = os.path.join(self._run_dir, f"{engine_id}.address")
        argv = [sys.executable, "-m", "baton_cli", command, "--engine-id", engine_id,
                "--host", cfg.host, "--port", "0", "--address-file", address_file,
                "--redis-url", self.redis_url,
                *self.redis_args,
                *(["--mock", cfg.mock] if cfg.mock else ["--num-threads", str(threads)]),
                *(["--cpus", cpus] if cpus else []), *self._model_args(),
                *(["--kv-cache-dtype", cfg.kv_cache_dtype] if cfg.kv_cache_dtype != "auto"
                  else []),
                *(["--lora-modules", *cfg.lora_modules] if cfg.lora_modules else []),
                *self._metrics_args(engine_id), *self.key_args, *self._disk_args(engine_id),
                *self.shared_args,
                *role_engine_args(cfg.engine_args, ROLE_COMMANDS[command])]
        self.engine_addresses[engine_id] = ""  # known once the engine wrote its address file
        self.address_files[engine_id] = address_file
        self.engine_roles[engine_id] = ROLE_COMMANDS[command]
        keys = self.keys
        self.spawned_at[engine_id] = time.monotonic()
        self.children.append(Child(
            engine_id, argv,
            is_ready=lambda: _engine_answers(self.engine_addresses[engine_id], keys),
            standby_argv=[*argv, "--standby"] if cfg.warm_standby else None))

    def redis_password_file(self) -> str:
        return self.redis.password_file if self.redis is not None else \
            self.config.redis_password_file

    def set_engine_role(self, engine_id: str, role: str) -> None:
        """`engine_id` was told to become `role` (S41): a restart starts it as one, and its
        warm spare, if any, is replaced by one of the new role."""
        old = self.engine_roles[engine_id]
        self.engine_roles[engine_id] = role
        child = next(c for c in self.children if c.name == engine_id)
        old_tail = role_engine_args(self.config.engine_args, old)
        head = child.argv[:len(child.argv) - len(old_tail)] if old_tail else child.argv
        head[3] = COMMAND_OF[role]  # [python, -m, baton_cli, COMMAND, ...]
        child.argv = [*head, *role_engine_args(self.config.engine_args, role)]
        if child.standby_argv is not None:
            child.standby_argv = [*child.argv, "--standby"]
            if child.standby is not None:
                child.standby.kill()
                child.standby = None
            child.spawn_standby()

    def _metrics_args(self, engine_id: str) -> list[str]:
        # A --metrics-port among the engine flags would give every engine the same port.
        if not self.config.metrics or "--metrics-port" in self.config.engine_args:
            return []
        port = free_port(self.config.host)
        self.metrics_urls[engine_id] = f"http://{self.config.host}:{port}/metrics"
        return ["--metrics-port", str(port)]

    def _load_cache_args(self) -> list[str]:
        """The engines' load cache flags, for the router's tokenizer too."""
        p = argparse.ArgumentParser(add_help=False)
        p.add_argument("--load-cache-dir", default="")
        p.add_argument("--no-load-cache", action="store_true")
        known = p.parse_known_args(self.config.engine_args)[0]
        return ["--no-load-cache"] if known.no_load_cache else \
            ["--load-cache-dir", known.load_cache_dir] if known.load_cache_dir else []

    def router_argv(self) -> list[str]:
        cfg = self.config
        return [sys.executable, "-m", "baton_cli", "router", "--host", cfg.host,
                "--port", str(cfg.router_port), "--redis-url", self.redis_url, *self.redis_args,
                "--routing", cfg.routing, *self._model_args(), *self.key_args,
                *self._load_cache_args(),
                *(["--api-keys-file", cfg.api_keys_file] if cfg.api_keys_file else []),
                *(["--cache-salt-per-key"] if cfg.cache_salt_per_key else []),
                *self._path_args()]

    def _start_router(self, deadline: float) -> None:
        cfg = self.config
        argv = self.router_argv()
        env = {"BATON_API_KEY": cfg.api_key} if cfg.api_key else None
        health = f"http://{cfg.host}:{cfg.router_port}/health"
        self.spawned_at["router"] = time.monotonic()
        router = Child("router", argv, env, is_ready=lambda: _http_ok(health))
        self.children.append(router)
        wait_http_ready(health, deadline, router)
        self.ready_s["router"] = time.monotonic() - self.spawned_at["router"]
        logger.info("router ready in %.1f s", self.ready_s["router"])
        for child in self.children:  # every child is up: now the spares, if asked for
            child.spawn_standby()
        if cfg.planner != "off":
            self._start_planner()

    def _start_planner(self) -> None:
        from baton.perf.profile import load as load_profile
        from baton_cli.live_planner import LivePlanner
        from planner.core import Planner, PlannerConfig
        from simulator.fleet import FleetConfig

        cfg = self.config
        profile = load_profile(cfg.planner_profile)
        fleet = FleetConfig(num_normal=0, num_prompt=1, num_completion=1)
        planner = Planner(profile, PlannerConfig(
            slos_ms=cfg.slos_ms, interval_s=cfg.planner_interval_s,
            window_s=cfg.planner_window_s, cooldown_s=cfg.planner_cooldown_s,
            apply=cfg.planner == "apply"), fleet)
        self.planner = LivePlanner(self, planner, cfg.planner_interval_s,
                                   cfg.planner_window_s).start()
        logger.info("planner (%s) every %.0f s on the last %.0f s of requests", cfg.planner,
                    cfg.planner_interval_s, cfg.planner_window_s)

    def _path_args(self) -> list[str]:
        cfg = self.config
        if cfg.profile:
            return ["--profile", os.path.abspath(cfg.profile),
                    *([] if cfg.pd_handoff_ms is None else
                      ["--pd-handoff-ms", str(cfg.pd_handoff_ms)])]
        if cfg.pd_threshold_tokens is not None:
            return ["--pd-threshold-tokens", str(cfg.pd_threshold_tokens)]
        return []

    def wait(self, poll_s: float = 0.5) -> int:
        """Supervise the children until a signal (returns 0), or until the router or every
        engine has been given up (returns 1)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: setattr(self, "_stopping", True))
        self.supervisor = Supervisor(self.children, self.config.restart)
        while not self._stopping:
            self.supervisor.poll()
            given_up = set(self.supervisor.given_up)
            if "router" in given_up or given_up >= set(self.engine_addresses):
                logger.error("gave up on %s; nothing can serve, stopping Baton",
                             ", ".join(sorted(given_up)))
                return 1
            time.sleep(poll_s)
        return 0

    def stop(self, timeout_s: float = 40.0) -> None:
        if self.planner is not None:
            self.planner.stop()
            self.planner = None
        for child in reversed(self.children):  # router first: no new work reaches the engines
            child.stop(timeout_s)
        self.children.clear()
        for server in (self.redis, self.kv_redis):
            if server is not None:
                server.stop()
        self.redis = self.kv_redis = None
        if self._own_key_dir:
            shutil.rmtree(self._own_key_dir, ignore_errors=True)
            self._own_key_dir = ""
        shutil.rmtree(self._run_dir, ignore_errors=True)

    def served_model(self) -> str:
        """The model id the router serves (clients must name it), or a placeholder."""
        import json
        import urllib.request

        url = f"http://{self.config.host}:{self.config.router_port}/v1/models"
        key = self.config.launcher_key()
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                        timeout=5.0) as resp:
                return json.load(resp)["data"][0]["id"]
        except (OSError, KeyError, IndexError, ValueError):
            return "MODEL"

    def banner(self) -> str:
        cfg = self.config
        base = f"http://{cfg.host}:{cfg.router_port}"
        model = self.served_model()
        auth = ' -H "Authorization: Bearer $BATON_API_KEY"' if cfg.launcher_key() else ""
        lines = [f"Baton is up: {base}/v1  (Redis {self.redis_url})"]
        if self.shared_args:
            lines.append(f"  KV shared tier {self.shared_args[1]}")
        ready = {name: f"  ready in {s:.1f} s" for name, s in self.ready_s.items()}
        lines += [f"  {name:<14} {addr}" + (f"  metrics {self.metrics_urls[name]}"
                                            if name in self.metrics_urls else "")
                  + ready.get(name, "") for name, addr in self.engine_addresses.items()]
        lines += [f"  {'router':<14} {base}/metrics" + ready.get("router", "")]
        lines += ["Try:",
                  f"  curl -s {base}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\",
                  f"    -d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", "
                  "\"content\": \"What is the capital of France?\"}], \"max_tokens\": 32, "
                  "\"temperature\": 0}'",
                  "Ctrl-C stops every process."]
        return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start Redis, the engines and the router on this host")
    p.add_argument("--host", default="127.0.0.1", help="address every process binds to")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port")
    p.add_argument("--prompt-engines", type=int, default=None,
                   help="prompt engines (default 1; 0 with --normal-engines)")
    p.add_argument("--completion-engines", type=int, default=None,
                   help="completion engines (default 1; 0 with --normal-engines)")
    p.add_argument("--normal-engines", type=int, default=0,
                   help="co-located engines: alone, instead of prompt+completion (whose counts "
                   "then default to 0); with explicit --prompt-engines and "
                   "--completion-engines, a mixed fleet where the router chooses each "
                   "request's path (--profile, --pd-threshold-tokens)")
    p.add_argument("--model", default="", help="GGUF file or Hugging Face folder (default: SmolLM2)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="every engine's KV pool dtype (baton engine --help); auto = --dtype")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) every engine serves beside the base model, "
                        "each under NAME (a request's `model`); more load at run time through "
                        "POST /v1/load_lora_adapter (README: LoRA adapters)")
    p.add_argument("--kv-disk-dir", default="",
                   help="the local disk tier (README: KV tiers): each engine writes the blocks "
                   "its pool evicts to DIR/ENGINE_ID and loads them back for later prompts; a "
                   "restarted engine finds its own files. Default: off")
    p.add_argument("--kv-disk-bytes", type=parse_bytes, default=0, metavar="N[K|M|G]",
                   help="each engine's disk tier size (default: the engines' default)")
    p.add_argument("--kv-shared-tier", default="", metavar="local[:SIZE]|URL",
                   help="the shared cluster tier (README: KV tiers), handed to every engine: "
                   "local[:SIZE] starts a Redis for it here (at most SIZE, default 1G, least "
                   "recently used blocks evicted), a redis:// URL uses that one. Default: off")
    p.add_argument("--kv-shared-password-file", default="",
                   help="file holding the password of a --kv-shared-tier URL")
    p.add_argument("--mock", default="", metavar="PROFILE.json",
                   help="mock engines (baton engine --mock): the profile's step times, no "
                        "model; the router tokenizes with the default model's tokenizer")
    p.add_argument("--redis-url", default="", help="use this Redis instead of starting one")
    p.add_argument("--redis-password-file", default="",
                   help="file holding the password of --redis-url (the user goes in the URL)")
    p.add_argument("--api-key", default=os.environ.get("BATON_API_KEY", ""))
    p.add_argument("--api-keys-file", default=os.environ.get("BATON_API_KEYS_FILE", ""),
                   help="the router's named API keys (YAML, 0600; see baton router --help)")
    p.add_argument("--cache-salt-per-key", action="store_true",
                   help="each API key's requests share a prefix cache only among themselves")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--no-cpu-pinning", action="store_true",
                   help="do not give each engine its own cores")
    p.add_argument("--no-metrics", action="store_true",
                   help="do not serve the engines' Prometheus metrics")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts of one process within --restart-window before giving up on it")
    p.add_argument("--restart-window", type=float, default=600.0,
                   help="seconds the restarts are counted over")
    p.add_argument("--routing", choices=("cache-aware", "least-loaded"), default="cache-aware",
                   help="the router's engine choice (see baton router --help)")
    p.add_argument("--profile", default="", metavar="PROFILE.json",
                   help="mixed fleets: the router chooses each request's path from this "
                        "profile's predicted costs (see baton router --help)")
    p.add_argument("--pd-threshold-tokens", type=int, default=None, metavar="N",
                   help="mixed fleets: disaggregated past N uncached prompt tokens instead")
    p.add_argument("--pd-handoff-ms", type=float, default=None,
                   help="with --profile: the disaggregated path's cost beyond the KV copy "
                        "(see baton router --help)")
    add_key_args(p)
    p.add_argument("--warm-standby", action="store_true",
                   help="keep a warm spare of each engine (imported, model loaded, waiting), "
                   "promoted when the engine exits: restarts in about a second")
    g = p.add_argument_group("planner (docs/scheduler.md S41: engines change roles in place)")
    g.add_argument("--planner", choices=("off", "advise", "apply"), default="off",
                   help="advise: publish the split it would choose (router /planner, "
                        "metrics); apply: also move engines between prompt and completion")
    g.add_argument("--planner-profile", default="", metavar="PROFILE.json",
                   help="the profile the planner predicts with (default: --profile)")
    g.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                   help="the planner's SLOs, e.g. ttft:2000 tpot:100")
    g.add_argument("--planner-interval", type=float, default=30.0)
    g.add_argument("--planner-window", type=float, default=120.0)
    g.add_argument("--planner-cooldown", type=float, default=300.0)
    p.add_argument("engine_args", nargs=argparse.REMAINDER,
                   help="after --: extra flags for every engine")
    p.set_defaults(func=run)


def engine_counts(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prompt, completion, normal) engines the flags ask for. --normal-engines alone means
    co-located serving only (the prompt and completion counts default to 0); with explicit
    prompt and completion counts too it is a mixed fleet (LaunchConfig refuses one of the two
    without the other by name)."""
    normal = args.normal_engines
    default = 0 if normal else 1
    prompt = default if args.prompt_engines is None else args.prompt_engines
    completion = default if args.completion_engines is None else args.completion_engines
    return prompt, completion, normal


def run(args: argparse.Namespace) -> int:
    try:
        prompt, completion, normal = engine_counts(args)
        config = LaunchConfig(
            host=args.host, router_port=args.port, model=args.model, redis_url=args.redis_url,
            redis_password_file=args.redis_password_file,
            num_prompt_engines=prompt, num_completion_engines=completion,
            num_normal_engines=normal, api_key=args.api_key,
            api_keys_file=args.api_keys_file, cache_salt_per_key=args.cache_salt_per_key,
            ready_timeout_s=args.ready_timeout,
            engine_args=[a for a in args.engine_args if a != "--"],
            pin_cpus=not args.no_cpu_pinning, metrics=not args.no_metrics,
            restart=RestartPolicy(max_restarts=args.max_restarts,
                                  window_s=args.restart_window),
            routing=args.routing, insecure=args.insecure, mock=args.mock,
            profile=args.profile, pd_threshold_tokens=args.pd_threshold_tokens,
            pd_handoff_ms=args.pd_handoff_ms,
            warm_standby=args.warm_standby, kv_cache_dtype=args.kv_cache_dtype,
            lora_modules=args.lora_modules,
            kv_disk_dir=args.kv_disk_dir, kv_disk_bytes=args.kv_disk_bytes,
            kv_shared_tier=args.kv_shared_tier,
            kv_shared_password_file=args.kv_shared_password_file,
            planner=args.planner,
            planner_profile=args.planner_profile or args.profile,
            slos_ms=parse_slos(args.goodput),
            planner_interval_s=args.planner_interval, planner_window_s=args.planner_window,
            planner_cooldown_s=args.planner_cooldown,
            # $BATON_CLUSTER_KEY_DIR is only the default: --insecure overrides it
            cluster_key_dir="" if args.insecure and args.cluster_key_dir == os.environ.get(
                ENV_KEY_DIR, "") else args.cluster_key_dir)
    except ValueError as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        return 2
    launcher = Launcher(config)
    try:
        launcher.start()
    except (LaunchError, RedisStartError) as exc:
        print(f"baton up: {exc}", file=sys.stderr)
        launcher.stop(timeout_s=5.0)
        return 1
    except KeyboardInterrupt:
        launcher.stop(timeout_s=5.0)
        return 130
    print(launcher.banner(), flush=True)
    code = launcher.wait()
    launcher.stop()
    return code
