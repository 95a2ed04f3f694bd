"""`baton planner`: the planner's loop (planner/loop.py) in a process of its own, beside a
fleet it did not start: on Kubernetes (deploy/k8s/planner.yaml) it changes the per-role
Deployments' replica counts (planner/kubernetes.py).

The same decision and flags as `baton up --planner` (planner/core.py: --goodput,
--planner-profile, --planner-interval, --planner-window, --planner-cooldown, --planner
advise|apply): every interval it reads the router's finished requests (`--router-url`,
`GET /planner/observations`, with the router's API key when it has keys), the engines' load
from their registry records (queues and KV usage; its egress reaches the registry, not the
engines, so no busy time), the fleet's current split from the actuator, decides, publishes the decision in the registry (signed with the
cluster key) where every router serves it (`GET /planner`,
`baton_router_planner_recommended_engines`), and in apply mode acts through the actuator.
With --port it serves `GET /health` (200 while its loop comes round) and `GET /metrics`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from baton.ops.cluster_keys import add_key_args
from baton_cli.launch_config import add_planner_args, planner_tuning

logger = logging.getLogger(__name__)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("planner", help="the P:D planner in its own process (Kubernetes: "
                       "scales the per-role Deployments)",
                       description="The planner's decision loop beside a fleet it did not "
                       "start: reads the router's finished requests, decides the prompt:"
                       "completion split (as baton up --planner), publishes it in the registry, "
                       "and with --planner apply scales the per-role Kubernetes Deployments.")
    p.add_argument("--router-url", default="http://127.0.0.1:8000",
                   help="a router: its finished requests are what the planner plans on")
    p.add_argument("--api-key", default=os.environ.get("BATON_API_KEY", ""),
                   help="the router's API key, when it has one (default $BATON_API_KEY)")
    p.add_argument("--api-keys-file", default=os.environ.get("BATON_API_KEYS_FILE", ""),
                   help="or the router's keys file: its first key (default "
                        "$BATON_API_KEYS_FILE)")
    p.add_argument("--redis-url", required=True,
                   help="the registry, where the planner publishes its decision for the routers")
    p.add_argument("--redis-password-file", default="",
                   help="the registry's password (default $BATON_REDIS_PASSWORD_FILE)")
    p.add_argument("--registry-prefix", default="baton", help="the routers' --registry-prefix")
    add_key_args(p)  # the cluster key signs the published decision
    add_planner_args(p.add_argument_group("the planner (the flags of baton up --planner)"),
                     mode="advise")
    k = p.add_argument_group("the actuator: Kubernetes (in-cluster service account)")
    k.add_argument("--actuator", choices=("kubernetes",), default="kubernetes",
                   help="where the split is read and changed")
    k.add_argument("--kube-namespace", default="",
                   help="the engines' namespace (default: the service account's)")
    k.add_argument("--prompt-deployment", default="baton-prompt-engine")
    k.add_argument("--completion-deployment", default="baton-completion-engine")
    k.add_argument("--kube-timeout", type=float, default=5.0,
                   help="seconds one API call may take (default 5)")
    p.add_argument("--host", default="127.0.0.1", help="bind address of --port")
    p.add_argument("--port", type=int, default=0,
                   help="serve /health and /metrics on this port (0: none)")
    p.set_defaults(func=run)


def _api_key(args: argparse.Namespace) -> str:
    if args.api_key:
        return args.api_key
    if args.api_keys_file:
        from router.api_keys import load_api_keys

        return load_api_keys(args.api_keys_file)[0].key
    return ""


def build(args: argparse.Namespace):
    """The loop the flags ask for (not started); ValueError or OSError names a bad flag."""
    from baton.ops.cluster_keys import keys_from_args
    from baton.ops.registry import RegistryConfig, make_registry, record_signing_key
    from baton.perf.profile import load as load_profile
    from baton.workload.results import parse_slos
    from planner.core import Planner, PlannerConfig
    from planner.kubernetes import KubeConfig, KubernetesActuator
    from planner.loop import PlannerLoop, RegistryLoads, RouterObservations
    from simulator.fleet import FleetConfig

    if not args.planner_profile:
        raise ValueError("--planner-profile PROFILE.json is needed: the planner predicts with it")
    config = PlannerConfig(slos_ms=parse_slos(args.goodput), apply=args.planner == "apply",
                           **planner_tuning(args))
    if not 0 < args.kube_timeout < 600:
        raise ValueError(f"--kube-timeout must be in (0, 600) s, got {args.kube_timeout}")
    planner = Planner(load_profile(args.planner_profile), config,
                      FleetConfig(num_normal=0, num_prompt=1, num_completion=1))
    keys = keys_from_args(args, "baton planner")
    actuator = KubernetesActuator(
        KubeConfig.in_cluster(args.kube_namespace, timeout_s=args.kube_timeout),
        args.prompt_deployment, args.completion_deployment)
    registry = make_registry(RegistryConfig(
        url=args.redis_url, prefix=args.registry_prefix,
        password_file=args.redis_password_file, signing_key=record_signing_key(keys)))
    observe = RouterObservations(args.router_url, args.planner_window, _api_key(args))
    return PlannerLoop(planner, actuator, observe, registry, args.planner_interval,
                       observe_engines=RegistryLoads(registry))


def run(args: argparse.Namespace) -> int:
    if args.planner == "off":
        print("baton planner: --planner off: nothing to do", file=sys.stderr)
        return 0
    try:
        loop = build(args)
    except (ValueError, OSError) as exc:
        message = str(exc)
        print(message if message.startswith("baton planner") else f"baton planner: {message}",
              file=sys.stderr)
        return 2
    server = serve_http(args.host, args.port, loop) if args.port else None

    def on_signal(signum, _frame) -> None:
        logger.info("planner: signal %d, stopping", signum)
        loop.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):  # as PID 1 in a container, SIGTERM needs one
        signal.signal(sig, on_signal)
    logger.info("planner (%s, %s actuator) every %.0f s on the last %.0f s of requests of %s",
                args.planner, args.actuator, args.planner_interval, args.planner_window,
                args.router_url)
    try:
        loop.run_forever()
    finally:
        if server is not None:
            server.shutdown()
        loop.registry.close()
    return 0


def metrics_text(loop) -> str:
    """Prometheus text: the last decision's split, decisions by action, skipped decisions."""
    lines = ["# HELP baton_planner_recommended_engines Engines of each role the planner's last "
             "decision recommends", "# TYPE baton_planner_recommended_engines gauge"]
    last = loop.decisions[-1] if loop.decisions else None
    for role, count in (last["recommended"] if last else {}).items():
        lines.append(f'baton_planner_recommended_engines{{role="{role}"}} {count}')
    lines += ["# HELP baton_planner_decisions_total Decisions by action",
              "# TYPE baton_planner_decisions_total counter"]
    for action, count in sorted(loop.actions.items()):
        lines.append(f'baton_planner_decisions_total{{action="{action}"}} {count}')
    lines += ["# HELP baton_planner_errors_total Decisions skipped on an error",
              "# TYPE baton_planner_errors_total counter",
              f"baton_planner_errors_total {loop.num_errors}"]
    return "\n".join(lines) + "\n"


def serve_http(host: str, port: int, loop) -> ThreadingHTTPServer:
    """/health: 200 while the loop came round within 3 intervals (a router or API server
    outage is a skipped decision, not a reason to restart), else 503; /metrics."""
    stale_s = max(3 * loop.interval_s, 60.0)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/health":
                age = time.monotonic() - loop.last_tick_s
                ok = age < stale_s
                body = json.dumps({"status": "ok" if ok else "stuck",
                                   "last_round_s_ago": round(age, 1)}).encode()
                self._reply(200 if ok else 503, "application/json", body)
            elif self.path == "/metrics":
                self._reply(200, "text/plain; version=0.0.4", metrics_text(loop).encode())
            else:
                self._reply(404, "text/plain", b"not found\n")

        def _reply(self, status: int, kind: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:  # probes every few seconds: not worth a line
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.1,), name="planner-http",
                     daemon=True).start()
    return server
