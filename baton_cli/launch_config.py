"""`baton up`'s configuration: its flags, the checks that refuse a bad combination before
anything starts, and which engine flags reach which role."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from baton.model.modes import KV_CACHE_DTYPES, check_kv_cache_dtype
from baton.ops.cluster_keys import add_key_args
from baton.ops.supervisor import RestartPolicy
from baton.protocol import NORMAL, PROMPT, ROLES
from baton.workload.results import parse_slos
from baton_cli.engine_args import add_common_args, lora_module, parse_bytes
from kv_transfer.auth import ENV_KEY_DIR
from router.cli import add_path_args

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
    planner_min_requests: int = 20  # requests a decision needs in its window
    planner_slo_target: float = 0.95  # under this share within the SLOs, the SLO is missed
    planner_slo_check_s: float = 5.0  # how often the SLO is checked between decisions
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
    pd_handoff_ms: float | None = None  # --pd-handoff-ms (with profile); None: the profile's
    admission_ttft_ms: float = 0.0  # --admission-ttft-ms (with profile; router/admission.py)
    admission_factor: float = 2.0  # --admission-factor
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
        if self.admission_ttft_ms and not self.profile:
            raise ValueError("--admission-ttft-ms admits against a TTFT predicted from "
                             "--profile; it needs --profile")
        if self.admission_ttft_ms:
            from router.admission import SloAdmission

            SloAdmission(self.admission_ttft_ms, self.admission_factor)  # names a bad value
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
            self.planner_config()  # ... and a bad setting here, naming it
        if self.cache_salt_per_key and not (self.api_key or self.api_keys_file):
            raise ValueError("--cache-salt-per-key needs API keys (--api-key or --api-keys-file)")
        for flag in ("--cluster-key-dir", "--insecure"):
            if flag in self.engine_args:
                raise ValueError(f"give {flag} to `baton up` itself, not after --: the router "
                                 "and every engine must share it")

    def planner_config(self):
        """The planner's config (planner/core.py `PlannerConfig`, which checks every value)."""
        from planner.core import PlannerConfig

        return PlannerConfig(
            slos_ms=self.slos_ms, interval_s=self.planner_interval_s,
            window_s=self.planner_window_s, cooldown_s=self.planner_cooldown_s,
            min_observations=self.planner_min_requests, slo_target=self.planner_slo_target,
            slo_check_s=self.planner_slo_check_s, apply=self.planner == "apply")

    def planner_fleet(self, profile):
        """The fleet the planner simulates: one prompt and one completion engine (its shapes
        replace the counts) with the engines' own limits, read from the flags after `--` as
        the engines read them (without this a user's `-- --max-num-seqs 16` ran engines the
        planner did not predict). `--kv-cache-gb` without `--num-blocks` scales the profiled
        engine's pool, measured at the default 1 GiB."""
        from simulator.fleet import FleetConfig

        parser = argparse.ArgumentParser(add_help=False)
        add_common_args(parser, PROMPT)
        args, _ = parser.parse_known_args(self.engine_args)
        num_blocks = args.num_blocks
        if not num_blocks and args.kv_cache_gb != 1.0:
            num_blocks = max(2, round(profile.model.num_blocks * args.kv_cache_gb))
        return FleetConfig(num_normal=0, num_prompt=1, num_completion=1, num_blocks=num_blocks,
                           max_num_seqs=args.max_num_seqs,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           enable_prefix_caching=args.enable_prefix_caching)

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


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    """`baton up`'s flags (the parser is baton_cli/launcher.py's)."""
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
    add_path_args(p)  # the router's flags, handed to it
    add_key_args(p)
    p.add_argument("--warm-standby", action="store_true",
                   help="keep a warm spare of each engine (imported, model loaded, waiting), "
                   "promoted when the engine exits: restarts in about a second")
    add_planner_args(p.add_argument_group(
        "planner (docs/scheduler.md S41: engines change roles in place)"),
        profile_help="the profile the planner predicts with (default: --profile)")
    p.add_argument("engine_args", nargs=argparse.REMAINDER,
                   help="after --: extra flags for every engine")


def add_planner_args(g: argparse._ActionsContainer, mode: str = "off",
                     profile_help: str = "the profile the planner predicts with") -> None:
    """The planner's flags, one set for `baton up --planner` and `baton planner`."""
    g.add_argument("--planner", choices=("off", "advise", "apply"), default=mode,
                   help="advise: publish the split it would choose (router /planner, "
                        "metrics); apply: also move engines between prompt and completion "
                        f"(default {mode})")
    g.add_argument("--planner-profile", default="", metavar="PROFILE.json", help=profile_help)
    g.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                   help="the planner's SLOs, e.g. ttft:2000 tpot:100")
    add_planner_tuning(g)


def add_planner_tuning(g: argparse._ActionsContainer) -> None:
    """How often and on what the planner decides (planner/core.py `PlannerConfig`): `baton up`,
    `baton planner` and `baton sim --planner`."""
    g.add_argument("--planner-interval", type=float, default=30.0,
                   help="seconds between two decisions (default 30)")
    g.add_argument("--planner-window", type=float, default=120.0,
                   help="seconds of requests each decision plans on (default 120)")
    g.add_argument("--planner-cooldown", type=float, default=300.0,
                   help="seconds after a change before the next (default 300)")
    g.add_argument("--planner-min-requests", type=int, default=20, metavar="N",
                   help="requests a decision needs in its window; with fewer it holds "
                        "(default 20)")
    g.add_argument("--planner-slo-target", type=float, default=0.95, metavar="SHARE",
                   help="under this share of the window's requests within the --goodput "
                        "SLOs, the SLO is missed and a predicted move becomes urgent "
                        "(default 0.95)")
    g.add_argument("--planner-slo-check", type=float, default=5.0, metavar="S",
                   help="seconds between two checks of the SLO between decisions (a miss "
                        "brings the next decision forward); 0: only at decisions (default 5)")


def planner_tuning(args: argparse.Namespace) -> dict:
    """`PlannerConfig`'s fields from add_planner_tuning's flags."""
    return dict(interval_s=args.planner_interval, window_s=args.planner_window,
                cooldown_s=args.planner_cooldown, min_observations=args.planner_min_requests,
                slo_target=args.planner_slo_target, slo_check_s=args.planner_slo_check)


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


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """The LaunchConfig `baton up`'s flags ask for; a ValueError names a bad one."""
    prompt, completion, normal = engine_counts(args)
    return LaunchConfig(
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
        pd_handoff_ms=args.pd_handoff_ms, admission_ttft_ms=args.admission_ttft_ms,
        admission_factor=args.admission_factor,
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
        planner_min_requests=args.planner_min_requests,
        planner_slo_target=args.planner_slo_target, planner_slo_check_s=args.planner_slo_check,
        # $BATON_CLUSTER_KEY_DIR is only the default: --insecure overrides it
        cluster_key_dir="" if args.insecure and args.cluster_key_dir == os.environ.get(
            ENV_KEY_DIR, "") else args.cluster_key_dir)
