"""The command-line side of the cluster's CURVE keys (kv_transfer/auth.py): one flag pair for
every engine command, the router, `baton probe` and `baton up`.

    --cluster-key-dir DIR   (default $BATON_CLUSTER_KEY_DIR) the key files: server.key,
                            client.key and whichever secrets the process needs
    --insecure              plain TCP on every internal wire: benchmarks only, and loud

A process given neither refuses to start: an engine never listens unauthenticated by accident.
`baton up` makes a private key dir itself (nothing to configure on one host); for many hosts
`baton keys DIR` writes one, to be turned into a Secret (deploy/k8s/README in the manifests).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kv_transfer.auth import ENV_KEY_DIR, ClusterKeys, generate

logger = logging.getLogger(__name__)

INSECURE_WARNING = ("*** %s runs with --insecure: its ZMQ wires (engine requests, KV side "
                    "channel) are NOT authenticated or encrypted; anyone who reaches its ports "
                    "can submit work and claim KV. Use this for benchmarks only. ***")


def add_key_args(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--cluster-key-dir", default=os.environ.get(ENV_KEY_DIR, ""),
                   help="directory of the cluster's CURVE keys (server.key, client.key and "
                        f"their *_secret files; default ${ENV_KEY_DIR})")
    p.add_argument("--insecure", action="store_true",
                   help="no CURVE on the internal ZMQ wires (benchmarks only; logs a warning)")


def resolve_keys(key_dir: str, insecure: bool, who: str) -> ClusterKeys | None:
    """The keys to use, or None under --insecure (with the warning); ValueError when neither
    is given, both are, or the dir does not hold valid keys."""
    if insecure:
        if key_dir and key_dir != os.environ.get(ENV_KEY_DIR, ""):
            raise ValueError("--insecure and --cluster-key-dir contradict each other")
        logger.warning(INSECURE_WARNING, who)
        return None
    if not key_dir:
        raise ValueError(f"{who}: no cluster keys: pass --cluster-key-dir DIR (or set "
                         f"${ENV_KEY_DIR}), or --insecure for a benchmark")
    return ClusterKeys.load(key_dir)


def keys_from_args(args: argparse.Namespace, who: str) -> ClusterKeys | None:
    return resolve_keys(args.cluster_key_dir, args.insecure, who)


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="write a new cluster key dir (CURVE server and client "
                       "pairs) for --cluster-key-dir or a Kubernetes Secret")
    p.add_argument("key_dir", help="directory to create (0700; files 0600)")
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    if os.path.exists(args.key_dir) and os.listdir(args.key_dir):
        print(f"baton keys: {args.key_dir} exists and is not empty", file=sys.stderr)
        return 1
    root = generate(args.key_dir)
    print(f"cluster keys written to {root}; for Kubernetes:\n  kubectl create secret generic "
          f"baton-cluster-keys --from-file={root}")
    return 0
