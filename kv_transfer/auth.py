"""CURVE keys and the ZAP check of every ZMQ socket inside a Baton cluster.

Two key pairs per cluster, one file pair each in a key directory (ZeroMQ's ZPL certificate
format, what `zmq.auth.load_certificate` reads):

    server.key  server.key_secret   the pair every socket that binds (engine, KV side channel)
                                    serves with; clients pin `server.key` as the server's key
    client.key  client.key_secret   the pair every socket that dials (router, probe, KV
                                    importer) presents; the ZAP handler admits only `client.key`

Why two pairs and not one used both ways: a process that only dials (the router, an operator's
probe) needs no server secret, so a leaked router Secret cannot impersonate an engine, and a
k8s Secret can hand each Deployment only the files it needs. A process that does both (a
completion engine serves the router and dials prompt engines) loads both secrets.

A peer without the client key, or that does not speak CURVE, fails the handshake: ZMQ drops it
before any message reaches the socket, so it never gets an answer. Each refused handshake is
counted per endpoint from the socket's monitor (`RefusalCounter`); ZAP alone would miss a
peer that offers no CURVE at all (the mechanism mismatch never reaches ZAP).

kv_transfer depends on nothing in baton, so this module is where both import it from.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

logger = logging.getLogger(__name__)

ENV_KEY_DIR = "BATON_CLUSTER_KEY_DIR"
SERVER, CLIENT = "server", "client"
# Handshake outcomes a monitor reports for a refused peer (libzmq >= 4.3).
_REFUSED_EVENTS = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                   | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


@dataclasses.dataclass(frozen=True)
class ClusterKeys:
    """The cluster's public keys and whichever secrets this process holds (z85, 40 bytes)."""

    server_public: bytes
    client_public: bytes
    # Empty: this process binds (dials) no cluster socket. Never in a repr or a log line.
    server_secret: bytes = dataclasses.field(default=b"", repr=False)
    client_secret: bytes = dataclasses.field(default=b"", repr=False)
    key_dir: str = ""  # where they were read from (passed on to child processes)

    def __post_init__(self) -> None:
        for name in ("server_public", "client_public", "server_secret", "client_secret"):
            value = getattr(self, name)
            if value and len(value) != 40:
                raise ValueError(f"{name} is {len(value)} bytes, a z85 CURVE key is 40")
        if not self.server_public or not self.client_public:
            raise ValueError("cluster keys need both public keys (server.key, client.key)")
        if not (self.server_secret or self.client_secret):
            raise ValueError("cluster keys hold no secret key: this process can neither "
                             "serve nor dial")

    @classmethod
    def load(cls, key_dir: str | os.PathLike) -> ClusterKeys:
        """Read KEY_DIR/{server,client}.key and the secrets present; ValueError naming the
        file that is missing, malformed, or readable by every user."""
        root = Path(key_dir)
        if not root.is_dir():
            raise ValueError(f"cluster key dir {str(root)!r} does not exist")
        public, secret = {}, {}
        for name in (SERVER, CLIENT):
            pub_path, sec_path = root / f"{name}.key", root / f"{name}.key_secret"
            if not pub_path.is_file():
                raise ValueError(f"cluster key dir {str(root)!r} lacks {pub_path.name}")
            public[name] = _read(pub_path)[0]
            if sec_path.is_file():
                if sec_path.stat().st_mode & 0o004:
                    raise ValueError(f"{sec_path} is readable by every user; chmod 600 it")
                pub, secret[name] = _read(sec_path)
                if pub != public[name] or not secret[name]:
                    raise ValueError(f"{sec_path} does not hold the secret of {pub_path.name}")
        return cls(public[SERVER], public[CLIENT], secret.get(SERVER, b""),
                   secret.get(CLIENT, b""), str(root))

    @property
    def can_serve(self) -> bool:
        return bool(self.server_secret)

    @property
    def can_dial(self) -> bool:
        return bool(self.client_secret)

    def apply_client(self, sock: zmq.Socket) -> None:
        """Before connect(): present the client pair, require the cluster's server key."""
        if not self.can_dial:
            raise ValueError(f"no client.key_secret in {self.key_dir!r}: this process cannot "
                             "dial a cluster socket")
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public

    def apply_server(self, sock: zmq.Socket, endpoint: str) -> None:
        """Before bind(): serve CURVE with the server pair and let the context's ZAP handler
        admit only the cluster's client key for `endpoint` (the ZAP domain)."""
        if not self.can_serve:
            raise ValueError(f"no server.key_secret in {self.key_dir!r}: this process cannot "
                             "serve a cluster socket")
        _authenticator(sock.context).allow(endpoint, self.client_public)
        sock.zap_domain = endpoint.encode()
        sock.curve_server = True
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public


def _read(path: Path) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as exc:
        raise ValueError(f"cannot read CURVE key file {path}: {exc}") from None
    return public, secret or b""


def generate(key_dir: str | os.PathLike | None = None) -> Path:
    """Write both key pairs into `key_dir` (default: a new private temp dir): the dir is
    0700, every file 0600. Returns the dir."""
    root = Path(key_dir) if key_dir else Path(tempfile.mkdtemp(prefix="baton-keys-"))
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    root.chmod(0o700)
    for name in (SERVER, CLIENT):
        public, secret = zmq.curve_keypair()
        for path, text in ((root / f"{name}.key", _zpl(public, b"")),
                           (root / f"{name}.key_secret", _zpl(public, secret))):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            path.chmod(0o600)
    return root


def _zpl(public: bytes, secret: bytes) -> str:
    """A certificate in the ZPL format zmq.auth.load_certificate reads."""
    lines = ["metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


class _Admission:
    """pyzmq credentials provider: a client key is admitted for the domains that allow it."""

    def __init__(self) -> None:
        self.domain_to_keys: dict[str, set[bytes]] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.domain_to_keys.get(domain, ())


class _ContextAuth:
    """The one ZAP handler (pyzmq's ThreadAuthenticator) of one ZMQ context."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.admission = _Admission()
        self.thread = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.thread.start()

    def allow(self, domain: str, client_public: bytes) -> None:
        self.admission.domain_to_keys.setdefault(domain, set()).add(client_public)
        self.thread.configure_curve_callback(domain, credentials_provider=self.admission)


_auth_lock = threading.Lock()
_ctx_to_auth: dict[int, tuple[zmq.Context, _ContextAuth]] = {}


def _authenticator(ctx: zmq.Context) -> _ContextAuth:
    # ZMQ allows one ZAP handler per context: the engine socket and the KV side channel of
    # one process share Context.instance(), hence one handler serving both domains.
    with _auth_lock:
        entry = _ctx_to_auth.get(id(ctx))
        if entry is None or entry[0] is not ctx:
            entry = _ctx_to_auth[id(ctx)] = (ctx, _ContextAuth(ctx))
        return entry[1]


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the ZAP handler of `ctx`, if it has one: before ctx.term(), which would otherwise
    wait for the handler's socket forever."""
    with _auth_lock:
        entry = _ctx_to_auth.pop(id(ctx), None)
    if entry is not None and entry[0] is ctx:
        entry[1].thread.stop()


class RefusalCounter:
    """Counts the refused handshakes of one bound socket, from its monitor. `drain` is called
    by the thread that owns the socket's loop (monitor sockets are not thread-safe)."""

    def __init__(self, sock: zmq.Socket, endpoint: str) -> None:
        self.endpoint = endpoint
        self.num_refused = 0
        self.monitor = sock.get_monitor_socket(_REFUSED_EVENTS)
        self._sock = sock

    def drain(self) -> int:
        """Take the pending monitor events; the refusals counted so far."""
        for _ in range(256):  # bounded: a peer retrying in a loop must not stall the caller
            if not self.monitor.poll(0):
                break
            event = parse_monitor_message(self.monitor.recv_multipart())
            self.num_refused += 1
            if self.num_refused <= 10 or self.num_refused % 1000 == 0:  # no log flood
                    logger.warning("%s refused a peer at handshake (event %#x, code %#x), "
                               "%d so far", self.endpoint, event["event"], event["value"],
                               self.num_refused)
        return self.num_refused

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)


def keys_from_env() -> ClusterKeys | None:
    """The keys $BATON_CLUSTER_KEY_DIR names, or None when it is unset."""
    key_dir = os.environ.get(ENV_KEY_DIR, "")
    return ClusterKeys.load(key_dir) if key_dir else None
