"""RouterConfig: everything the router process needs, validated once at start-up."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field

from baton.ops.cluster_keys import resolve_keys
from baton.protocol import MAX_CHOICES, ROLES
from kv_transfer.auth import ENV_KEY_DIR, ClusterKeys
from router.api_keys import ENV_KEYS_FILE, ApiKey, load_api_keys

ROUTING_POLICIES = ("cache-aware", "least-loaded")


@dataclass
class RouterConfig:
    # HTTP bind address; loopback by default so nothing is exposed unless asked for.
    host: str = "127.0.0.1"
    # HTTP port (0 lets the OS pick one; tests use that).
    port: int = 8000
    # redis://host:port/db of the engine registry; empty means the static `engines` list.
    registry_url: str = ""
    # Key namespace in Redis, the same as the engines' RegistryConfig.prefix.
    registry_prefix: str = "baton"
    # Named API keys, each with its own rate limit and usage counters (router/api_keys.py);
    # "" = $BATON_API_KEYS_FILE, or none. `api_key`, if set too, is one more key, "default".
    api_keys_file: str = ""
    # Every request's cache salt is namespaced by its API key's name: keys share no cache.
    cache_salt_per_key: bool = False
    # File holding the registry's Redis password; "" = $BATON_REDIS_PASSWORD_FILE, or none.
    registry_password_file: str = ""
    # Static engines, `ROLE=ADDRESS[,SIDE_CHANNEL]`, used when registry_url is empty.
    engines: list[str] = field(default_factory=list)
    # Bearer key clients must send; empty = no authentication. Falls back to $BATON_API_KEY.
    api_key: str = ""
    # GGUF file or Hugging Face folder the tokenizer and chat template come from; empty = SmolLM2.
    model_path: str = ""
    # The load cache (baton/load_cache.py) the tokenizer is read from, and written to on a
    # miss; None = parse the model file.
    load_cache_dir: str | None = None
    # Name served by /v1/models and required in requests; empty = derived from the model.
    model_name: str = ""
    # Context length override; 0 = the model's own.
    max_model_len: int = 0
    # How often the engine list (and each engine's load) is re-read from the registry.
    refresh_s: float = 1.0
    # Longest wait for the first delta of an engine that got a fresh prompt (queueing + prefill).
    first_token_timeout_s: float = 120.0
    # Longest wait between two deltas of a running request, KV pull included.
    token_timeout_s: float = 60.0
    # How long a request waits for a live engine of a role (one restarting) before a 503.
    engine_wait_timeout_s: float = 30.0
    # Further prompt engines (or the same one, restarted) a request tries after its prompt
    # engine failed before the first token.
    prompt_retry_limit: int = 2
    # Migrations a request may go through: each time an engine fails it mid-stream, the router
    # re-prefills prompt + tokens so far and continues on live engines; 0 = fail at once.
    migration_limit: int = 3
    # The most choices (OpenAI's n) one request may ask for (each is a sequence on the
    # engines, sharing the prompt's KV blocks); past it, a 400 naming n.
    max_n: int = 16
    # Seconds an engine that failed a request is avoided unless it is the only one left.
    failure_cooldown_s: float = 5.0
    # An engine socket not connected this long after it was opened counts as down.
    connect_grace_s: float = 2.0
    # Shutdown: how long in-flight HTTP requests may still run before they are cut.
    graceful_shutdown_s: int = 10
    # Largest request body read (declared or chunked); past it, 413. The longest legal prompt
    # of SmolLM2 (8192 tokens of at most 81 characters) is ~0.7 MB of text.
    max_request_bytes: int = 4 * 1024 * 1024
    # Generation requests in flight at once (reading, tokenizing, generating); past it, 429.
    max_concurrent_requests: int = 512
    # A request body must arrive within this long of its headers; past it, 408.
    body_timeout_s: float = 30.0
    # A connection must send a request's whole headers within this long of opening (or of
    # its previous response); past it, the connection is dropped.
    header_timeout_s: float = 10.0
    # An idle keep-alive connection is closed after this long (uvicorn's timeout_keep_alive).
    keep_alive_timeout_s: int = 5
    # Processes that parse bodies, render chat templates and tokenize, off the event loop
    # (tokenizing holds the GIL); 0 = one thread of the router process (tests).
    num_prepare_workers: int = 2
    # How engines are chosen (router/selection.py): "cache-aware" weighs the prompt blocks an
    # engine holds (its KV events) against its load; "least-loaded" ignores the caches.
    routing: str = "cache-aware"
    # cache-aware cost = kv_overlap_weight * blocks the engine lacks + its active blocks.
    kv_overlap_weight: float = 1.0
    # Mixed fleets (NORMAL engines beside PROMPT + COMPLETION ones), each request's path
    # (router/path.py): a [sim] profile (`baton profile`) to predict each path's cost from;
    # "" = no profile (the default threshold, unless pd_threshold_tokens is given).
    profile_path: str = ""
    # Static rule instead: disaggregated when the prompt tokens a normal engine would prefill
    # exceed this; None = no static rule (the profile's prediction, else the default threshold).
    pd_threshold_tokens: int | None = None
    # The disaggregated path's cost beyond the profile's KV copy (the extra hop, admission, the
    # pull's claim), in milliseconds; used with profile_path. None: the profile's measured
    # `path.handoff_ms`, else router/path.py's DEFAULT_HANDOFF_MS.
    pd_handoff_ms: float | None = None
    # SLO-aware admission (router/admission.py): a fresh request whose predicted TTFT (from
    # profile_path) is over admission_factor x admission_ttft_ms is answered 429 with
    # Retry-After at once; 0 = off.
    admission_ttft_ms: float = 0.0
    admission_factor: float = 2.0
    # The cluster's CURVE keys (kv_transfer/auth.py) the engine sockets dial with; empty =
    # $BATON_CLUSTER_KEY_DIR. One of the two, or `insecure`, is required.
    cluster_key_dir: str = ""
    # Plain TCP to the engines: benchmarks only (a warning at start).
    insecure: bool = False
    # Loaded from cluster_key_dir by __post_init__; None exactly when insecure.
    cluster_keys: ClusterKeys | None = field(default=None, init=False, repr=False)
    # The keys a request must show (api_key and api_keys_file's); empty = open.
    api_keys: list[ApiKey] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.api_key:
            self.api_key = os.environ.get("BATON_API_KEY", "")
        if not self.api_keys_file:
            self.api_keys_file = os.environ.get(ENV_KEYS_FILE, "")
        self.api_keys = load_api_keys(self.api_keys_file) if self.api_keys_file else []
        if self.api_key:
            if any(k.name == "default" or k.key == self.api_key for k in self.api_keys):
                raise ValueError("api_key repeats a key (or the name 'default') of "
                                 f"{self.api_keys_file}")
            self.api_keys.append(ApiKey("default", self.api_key))
        if self.cache_salt_per_key and not self.api_keys:
            raise ValueError("cache_salt_per_key needs API keys (api_key or api_keys_file)")
        if not self.cluster_key_dir and not self.insecure:
            self.cluster_key_dir = os.environ.get(ENV_KEY_DIR, "")
        self.cluster_keys = resolve_keys(self.cluster_key_dir, self.insecure, "baton router")
        if self.cluster_keys is not None and not self.cluster_keys.can_dial:
            raise ValueError(f"cluster_key_dir {self.cluster_key_dir!r} lacks "
                             "client.key_secret, which the router dials with")
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if self.host != "localhost":
                raise ValueError(f"host must be an IP address or localhost, got {self.host!r}") from None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.registry_url and self.engines:
            raise ValueError("give either registry_url or static engines, not both")
        if self.registry_url and not self.registry_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"registry_url must be a redis:// URL, got {self.registry_url!r}")
        for entry in self.engines:
            role, sep, address = entry.partition("=")
            if not sep or role not in ROLES or not address:
                raise ValueError(f"bad engine entry {entry!r}: expected ROLE=ADDRESS[,SIDE], ROLE in {ROLES}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        for name in ("refresh_s", "first_token_timeout_s", "token_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.connect_grace_s <= 0:
            raise ValueError(f"connect_grace_s must be > 0, got {self.connect_grace_s}")
        if self.graceful_shutdown_s < 0:
            raise ValueError(f"graceful_shutdown_s must be >= 0, got {self.graceful_shutdown_s}")
        for name in ("max_request_bytes", "max_concurrent_requests", "body_timeout_s",
                     "header_timeout_s", "keep_alive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_prepare_workers < 0:
            raise ValueError(f"num_prepare_workers must be >= 0, got {self.num_prepare_workers}")
        if self.engine_wait_timeout_s < 0:
            raise ValueError(f"engine_wait_timeout_s must be >= 0, got {self.engine_wait_timeout_s}")
        if self.prompt_retry_limit < 0:
            raise ValueError(f"prompt_retry_limit must be >= 0, got {self.prompt_retry_limit}")
        if self.routing not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {self.routing!r}")
        if not 0 <= self.kv_overlap_weight < float("inf"):
            raise ValueError(f"kv_overlap_weight must be >= 0 and finite, got {self.kv_overlap_weight}")
        if not isinstance(self.migration_limit, int) or self.migration_limit < 0:
            raise ValueError(f"migration_limit must be an int >= 0, got {self.migration_limit!r}")
        if not isinstance(self.max_n, int) or not 1 <= self.max_n <= MAX_CHOICES:
            raise ValueError(f"max_n must be an int in [1, {MAX_CHOICES}], got {self.max_n!r}")
        if self.failure_cooldown_s < 0:
            raise ValueError(f"failure_cooldown_s must be >= 0, got {self.failure_cooldown_s}")
        self._check_path_policy()

    def _check_path_policy(self) -> None:
        threshold = self.pd_threshold_tokens
        if threshold is not None and (not isinstance(threshold, int) or threshold < 0):
            raise ValueError(f"pd_threshold_tokens must be an int >= 0, got {threshold!r}")
        if threshold is not None and self.profile_path:
            raise ValueError("give either pd_threshold_tokens (a static rule) or profile_path "
                             "(predicted costs), not both")
        if self.pd_handoff_ms is not None and not 0 <= self.pd_handoff_ms < float("inf"):
            raise ValueError(f"pd_handoff_ms must be >= 0 and finite, got {self.pd_handoff_ms}")
        if self.admission_ttft_ms:
            from router.admission import SloAdmission

            SloAdmission(self.admission_ttft_ms, self.admission_factor)  # ValueError naming it
            if not self.profile_path:
                raise ValueError("admission_ttft_ms needs profile_path: the TTFT it admits "
                                 "against is predicted from the profile")
        if self.profile_path:
            from baton.perf.profile import load

            load(self.profile_path)  # ProfileError (a ValueError) naming the file and field
