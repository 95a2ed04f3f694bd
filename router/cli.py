"""`baton router`: the OpenAI-compatible HTTP front end."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from baton.load_cache import default_cache_dir
from baton.ops.cluster_keys import add_key_args
from router.path import DEFAULT_HANDOFF_MS, DEFAULT_THRESHOLD_TOKENS

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the OpenAI-compatible router")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    p.add_argument("--port", type=int, default=8000, help="HTTP port")
    p.add_argument("--redis-url", default=os.environ.get("BATON_REDIS_URL", ""),
                   help="engine registry; empty = the static --engine list")
    p.add_argument("--redis-password-file", default="",
                   help="file holding the registry's Redis password (default "
                        "$BATON_REDIS_PASSWORD_FILE); the user goes in the URL")
    p.add_argument("--registry-prefix", default="baton")
    p.add_argument("--engine", action="append", default=[], metavar="ROLE=ADDR[,SIDECHANNEL]",
                   help="a static engine (repeatable), e.g. normal=tcp://127.0.0.1:7000")
    p.add_argument("--api-key", default="", help="required bearer key (default $BATON_API_KEY)")
    p.add_argument("--api-keys-file", default="",
                   help="YAML file of named API keys, each with its own requests_per_minute "
                        "(429 past it) and usage counters (default $BATON_API_KEYS_FILE)")
    p.add_argument("--cache-salt-per-key", action="store_true",
                   help="each API key's requests share a prefix cache only among themselves")
    p.add_argument("--model", default="", help="GGUF file or Hugging Face folder (default SmolLM2)")
    p.add_argument("--load-cache-dir", default="",
                   help="read the tokenizer from the engines' load cache, written there on a miss "
                   "(default: $BATON_LOAD_CACHE_DIR, else ~/.cache/baton/load)")
    p.add_argument("--no-load-cache", action="store_true",
                   help="parse the model file for the tokenizer, no load cache")
    p.add_argument("--served-model-name", default="", help="name clients use (default: the file's)")
    p.add_argument("--max-model-len", type=int, default=0, help="0 = the model's context")
    p.add_argument("--refresh", type=float, default=1.0, help="registry refresh period, seconds")
    p.add_argument("--first-token-timeout", type=float, default=120.0,
                   help="seconds an engine may take to answer a new request")
    p.add_argument("--token-timeout", type=float, default=60.0,
                   help="seconds an engine may stay silent in a running request")
    p.add_argument("--engine-wait-timeout", type=float, default=30.0,
                   help="seconds a request waits for a live engine of a role (one restarting) "
                        "before a 503 naming the role")
    p.add_argument("--prompt-retries", type=int, default=2,
                   help="prompt engines a request tries again after one failed before the "
                        "first token (the same one once it is back from a restart)")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times a request moves to other engines after one failed mid-stream "
                        "(prompt + tokens so far are prefilled again); 0 = fail at once")
    p.add_argument("--max-n", type=int, default=16,
                   help="the most choices (n) one request may ask for; past it, a 400")
    p.add_argument("--graceful-shutdown", type=int, default=10,
                   help="seconds in-flight requests may still run at shutdown")
    p.add_argument("--max-request-bytes", type=int, default=4 * 1024 * 1024,
                   help="largest request body read; past it, 413")
    p.add_argument("--max-concurrent-requests", type=int, default=512,
                   help="generation requests in flight at once; past it, 429 with Retry-After")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive; past it, 408")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers")
    p.add_argument("--keep-alive-timeout", type=int, default=5,
                   help="seconds an idle keep-alive connection stays open")
    p.add_argument("--prepare-workers", type=int, default=2,
                   help="processes that parse and tokenize request bodies off the event loop")
    p.add_argument("--routing", choices=("cache-aware", "least-loaded"), default="cache-aware",
                   help="cache-aware: weigh the prompt blocks each engine holds against its "
                        "load; least-loaded: load only")
    p.add_argument("--kv-overlap-weight", type=float, default=1.0,
                   help="cache-aware cost = weight * blocks the engine lacks + active blocks")
    add_path_args(p)
    add_key_args(p)
    p.set_defaults(func=run)


def add_path_args(p: argparse._ActionsContainer) -> None:
    """The path choice of a mixed fleet (router/path.py) and SLO-aware admission
    (router/admission.py); `baton up` takes the same flags and passes them on."""
    p.add_argument("--profile", default="", metavar="PROFILE.json",
                   help="mixed fleets: choose each request's path (co-located or "
                        "disaggregated) from this profile's predicted costs (baton profile); "
                        f"without it, disaggregated past {DEFAULT_THRESHOLD_TOKENS} uncached "
                        "prompt tokens")
    p.add_argument("--pd-threshold-tokens", type=int, default=None, metavar="N",
                   help="mixed fleets: a static rule instead: disaggregated when a normal engine "
                        "would prefill more than N prompt tokens (its cached prefix left out)")
    p.add_argument("--admission-ttft-ms", type=float, default=0.0, metavar="MS",
                   help="SLO-aware admission (needs --profile): answer 429 with Retry-After at "
                        "once when a request's predicted TTFT under the current load is over "
                        "--admission-factor x MS; 0 = off")
    p.add_argument("--admission-factor", type=float, default=2.0,
                   help="with --admission-ttft-ms: refuse past this multiple of the SLO")
    p.add_argument("--pd-handoff-ms", type=float, default=None,
                   help="with --profile: the disaggregated path's cost beyond the KV copy "
                        "(the extra hop, admission, the pull's claim), milliseconds (default: "
                        f"the profile's measured path.handoff_ms, else {DEFAULT_HANDOFF_MS:g})")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from router.app import create_app
    from router.limits import uvicorn_limits

    try:
        config = _config(args)
    except ValueError as exc:
        print(f"baton router: {exc}", file=sys.stderr)
        return 2
    logger.info("router config: %s", {**vars(config), "api_key": "***" if config.api_key else ""})
    uvicorn.run(create_app(config), host=config.host, port=config.port,
                log_level=logging.getLogger().getEffectiveLevel(), access_log=False,
                **uvicorn_limits(config))
    return 0


def _config(args: argparse.Namespace):
    """The RouterConfig of the flags; ValueError naming a bad one (a bad profile's field)."""
    from router.config import RouterConfig

    return RouterConfig(
        host=args.host, port=args.port, registry_url=args.redis_url,
        registry_password_file=args.redis_password_file, api_keys_file=args.api_keys_file,
        cache_salt_per_key=args.cache_salt_per_key,
        registry_prefix=args.registry_prefix, engines=args.engine, api_key=args.api_key,
        model_path=args.model, model_name=args.served_model_name,
        load_cache_dir=None if args.no_load_cache else args.load_cache_dir or default_cache_dir(),
        max_model_len=args.max_model_len, refresh_s=args.refresh,
        first_token_timeout_s=args.first_token_timeout, token_timeout_s=args.token_timeout,
        engine_wait_timeout_s=args.engine_wait_timeout, prompt_retry_limit=args.prompt_retries,
        migration_limit=args.migration_limit, max_n=args.max_n,
        graceful_shutdown_s=args.graceful_shutdown, max_request_bytes=args.max_request_bytes,
        max_concurrent_requests=args.max_concurrent_requests, body_timeout_s=args.body_timeout,
        header_timeout_s=args.header_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
        num_prepare_workers=args.prepare_workers, routing=args.routing,
        kv_overlap_weight=args.kv_overlap_weight, cluster_key_dir=args.cluster_key_dir,
        insecure=args.insecure, profile_path=args.profile,
        pd_threshold_tokens=args.pd_threshold_tokens, pd_handoff_ms=args.pd_handoff_ms,
        admission_ttft_ms=args.admission_ttft_ms, admission_factor=args.admission_factor)
