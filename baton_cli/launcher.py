"""`baton up`: start Redis, the engines and the router on this host, and stop them together.

Every child is a separate process (`python -m baton_cli ROLE ...`) that dies with the launcher
(PR_SET_PDEATHSIG), so a launcher killed at 3 a.m. leaves no orphan holding a port or a pool.
The router starts beside the engines; start-up waits for each engine to answer a stats
request and for the router's /health to list every engine; any child that exits or a wait that
times out during start-up stops everything with one clear message. Once up, a child that exits
is restarted (baton/ops/supervisor.py: same engine id and port, backoff, a limit) while the
others keep serving; SIGTERM or Ctrl-C stops them all.

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

from baton.ops.cluster_keys import INSECURE_WARNING
from baton.ops.cpus import cpu_shares, engine_threads
from baton.ops.ports import free_port, port_is_free
from baton.ops.redis_server import RedisServer, RedisStartError
from baton.ops.supervisor import Child, LaunchError, Supervisor
from baton.protocol import COMPLETION, NORMAL, PROMPT
from baton_cli.engine_args import COMMAND_OF, ROLE_COMMANDS
from baton_cli.launch_config import (
    LaunchConfig,
    add_up_arguments,
    config_from_args,
    role_engine_args,
)
from baton_cli.readiness import engine_answers, http_ok, wait_engines_ready, wait_http_ready
from kv_transfer.auth import ClusterKeys, generate

logger = logging.getLogger(__name__)



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
        # Made when the first engine starts (a Launcher built for its argv alone leaves none).
        self._run_dir_path = ""

    @property
    def _run_dir(self) -> str:
        if not self._run_dir_path:
            self._run_dir_path = tempfile.mkdtemp(prefix="baton-up-")
        return self._run_dir_path

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
        # The router starts beside the engines (its imports, tokenizer and prepare workers take
        # as long as a mock engine's start) and learns them from the registry as each comes up.
        router = self._spawn_router()
        wait_engines_ready(self.children, self.engine_addresses, deadline, self.ready_s,
                           self.spawned_at, self.keys, self.address_files)
        self._wait_router(router, deadline, counts)

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
            is_ready=lambda: engine_answers(self.engine_addresses[engine_id], keys),
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

    @property
    def router_health_url(self) -> str:
        return f"http://{self.config.host}:{self.config.router_port}/health"

    def _spawn_router(self) -> Child:
        cfg = self.config
        env = {"BATON_API_KEY": cfg.api_key} if cfg.api_key else None
        health = self.router_health_url
        self.spawned_at["router"] = time.monotonic()
        router = Child("router", self.router_argv(), env, is_ready=lambda: http_ok(health))
        self.children.append(router)
        return router

    def _wait_router(self, router: Child, deadline: float, counts: dict[str, int]) -> None:
        """Until the router's /health is ok and lists every engine started (`counts`: the
        last index of each role): the banner's first request finds them all."""
        cfg = self.config

        def lists_all(health: dict) -> bool:
            engines = health.get("engines") or {}
            return all(engines.get(role, 0) > idx for role, idx in counts.items())

        wait_http_ready(self.router_health_url, deadline, router, accept=lists_all)
        self.ready_s["router"] = time.monotonic() - self.spawned_at["router"]
        logger.info("router ready in %.1f s", self.ready_s["router"])
        for child in self.children:  # every child is up: now the spares, if asked for
            child.spawn_standby()
        if cfg.planner != "off":
            self._start_planner()

    def _start_planner(self) -> None:
        from baton.perf.profile import load as load_profile
        from baton_cli.live_planner import LivePlanner
        from planner.core import Planner

        cfg = self.config
        profile = load_profile(cfg.planner_profile)
        planner = Planner(profile, cfg.planner_config(), cfg.planner_fleet(profile))
        self.planner = LivePlanner(self, planner, cfg.planner_interval_s,
                                   cfg.planner_window_s).start()
        logger.info("planner (%s) every %.0f s on the last %.0f s of requests", cfg.planner,
                    cfg.planner_interval_s, cfg.planner_window_s)

    def _path_args(self) -> list[str]:
        cfg = self.config
        if cfg.profile:
            return ["--profile", os.path.abspath(cfg.profile),
                    *([] if cfg.pd_handoff_ms is None else
                      ["--pd-handoff-ms", str(cfg.pd_handoff_ms)]),
                    *([] if not cfg.admission_ttft_ms else
                      ["--admission-ttft-ms", str(cfg.admission_ttft_ms),
                       "--admission-factor", str(cfg.admission_factor)])]
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
        # The router first: no new work reaches the engines. Then the engines all at once:
        # each one's graceful shutdown runs beside the others' (one after another, a fleet of
        # N took N shutdowns).
        engines = [c for c in self.children if c.name != "router"]
        for child in self.children:
            if child.name == "router":
                child.stop(timeout_s)
        for child in engines:
            child.terminate()
        for child in engines:
            child.wait_stopped(timeout_s)
        self.children.clear()
        for server in (self.redis, self.kv_redis):
            if server is not None:
                server.stop()
        self.redis = self.kv_redis = None
        if self._own_key_dir:
            shutil.rmtree(self._own_key_dir, ignore_errors=True)
            self._own_key_dir = ""
        if self._run_dir_path:
            shutil.rmtree(self._run_dir_path, ignore_errors=True)
            self._run_dir_path = ""

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
    add_up_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
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
