"""Hostile and heavy input against a running router (uvicorn on loopback, the real prepare
worker processes, a scripted engine): each is a 4xx, never a 5xx, and the router keeps serving.

Raw sockets where a polite client cannot misbehave: declared and chunked oversized bodies,
truncated bodies, slow and missing headers.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from router.config import RouterConfig
from tests.cluster import wait_for
from tests.router.conftest import router_process, serve_router
from tests.router.scripted_engine import ScriptedEngine

MODEL = "SmolLM2-135M-Instruct"
LIMIT = 4 * 1024 * 1024  # RouterConfig's default max_request_bytes
TIMEOUT_S = 1.0  # header and body timeouts here
OK_BODY = {"model": MODEL, "prompt": "Count:", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def router(model_info):
    engine = ScriptedEngine("normal", model_info.tokenizer.encode(" one two three four"))
    config = RouterConfig(engines=[f"normal={engine.address}"], header_timeout_s=TIMEOUT_S,
                          body_timeout_s=TIMEOUT_S)
    assert config.max_request_bytes == LIMIT
    try:
        with serve_router(config, model_info) as url:
            yield url
    finally:
        engine.close()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _assert_serving(url: str) -> None:
    done = httpx.post(f"{url}/v1/completions", json=OK_BODY, timeout=30)
    assert done.status_code == 200, done.text
    assert done.json()["choices"][0]["text"] == " one two three"


def _raw(url: str, head: bytes, body_parts=(), shut_write: bool = False,
         timeout_s: float = 30.0) -> bytes:
    """Send `head` and then each of `body_parts` (stopping if the server closes), return all
    the server answered until it closed or `timeout_s` passed."""
    sock = socket.create_connection(("127.0.0.1", _port(url)), timeout=timeout_s)
    try:
        sock.sendall(head)
        for part in body_parts:
            try:
                sock.sendall(part)
            except (BrokenPipeError, ConnectionResetError):
                break
        if shut_write:
            sock.shutdown(socket.SHUT_WR)
        answer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            answer += chunk
            if b"\r\n\r\n" in answer and _is_complete(answer):
                break
        return answer
    finally:
        sock.close()


def _is_complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def _head(path: str = "/v1/completions", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{extra}\r\n").encode()


def test_declared_oversized_body_is_413_before_reading(router):
    start = time.monotonic()
    answer = _raw(router, _head(extra="Content-Length: 60000000\r\n"), [b'{"model": "'])
    assert _status(answer) == 413, answer[:300]
    assert str(LIMIT) in answer.decode() and "max-request-bytes" in answer.decode()
    assert time.monotonic() - start < 5
    _assert_serving(router)


def test_chunked_oversized_body_is_413_while_reading(router):
    chunk = b"a" * 65536
    parts = [b'10\r\n{"prompt": "aaaa\r\n'] + [b"10000\r\n" + chunk + b"\r\n"] * 200  # 12.5 MiB
    answer = _raw(router, _head(extra="Transfer-Encoding: chunked\r\n"), parts)
    assert _status(answer) == 413, answer[:300]
    assert str(LIMIT) in answer.decode()
    _assert_serving(router)


def _deep(n: int) -> bytes:
    return b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * n + b"]" * n + b"}"


HOSTILE_BODIES = {
    "nested 50,000 deep": _deep(50_000),
    "nested 900 deep": _deep(900),
    "top level nested": b"[" * 50_000 + b"]" * 50_000,
    "unknown field nested": b'{"model": "m", "x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "5,000-digit integer": b'{"model": "%s", "prompt": "hi", "max_tokens": 1%s}' % (
        MODEL.encode(), b"0" * 5000),
    "65-bit seed": json.dumps({"model": MODEL, "prompt": "hi", "seed": 2**64}).encode(),
    "float overflow": b'{"model": "%s", "prompt": "hi", "temperature": 1e400}' % MODEL.encode(),
    "huge penalty": json.dumps({"model": MODEL, "prompt": "hi",
                                "presence_penalty": 1e308}).encode(),
    "huge max_tokens": json.dumps({"model": MODEL, "prompt": "hi",
                                   "max_tokens": 2**63 - 1}).encode(),
    "huge logit_bias key": json.dumps({"model": MODEL, "prompt": "hi",
                                       "logit_bias": {"9" * 4000: 1}}).encode(),
    "string body": b'"hello"',
    "null body": b"null",
    "number body": b"12",
    "prompt object": json.dumps({"model": MODEL, "prompt": {"a": 1}}).encode(),
    "logit_bias list": json.dumps({"model": MODEL, "prompt": "hi", "logit_bias": [1]}).encode(),
    "messages object": json.dumps({"model": MODEL, "messages": {"role": "user"}}).encode(),
    "bad UTF-8": b'{"model": "\xff\xfe", "prompt": "hi"}',
    "lone surrogate prompt": b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode(),
    "lone surrogate model": b'{"model": "\\udfff", "prompt": "hi"}',
    "truncated JSON": b'{"model": "%s", "prompt": "hi' % MODEL.encode(),
    "2M token ids": b'{"model": "%s", "prompt": [' % MODEL.encode() + b"1," * 2_000_000
    + b"1]}",
    "text past any context": json.dumps({"model": MODEL, "prompt": "word " * 700_000}).encode(),
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_bodies_are_400_in_openai_shape(router, name):
    response = httpx.post(f"{router}/v1/completions", content=HOSTILE_BODIES[name],
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400, (name, response.text[:300])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    chat = httpx.post(f"{router}/v1/chat/completions", content=HOSTILE_BODIES[name], timeout=60)
    assert 400 <= chat.status_code < 500, (name, chat.text[:300])
    _assert_serving(router)


def test_chat_hostile_messages(router):
    for body in ({"model": MODEL, "messages": [{"role": "user", "content": "a\ud800"}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3_000_000}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
                 {"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 50_000}):
        raw = json.dumps(body).encode()
        response = httpx.post(f"{router}/v1/chat/completions", content=raw, timeout=60)
        assert response.status_code == 400, response.text[:300]
    _assert_serving(router)


def test_truncated_body_then_gone_leaves_the_router_serving(router):
    answer = _raw(router, _head(extra="Content-Length: 1000\r\n"), [b'{"model": "x"'],
                  shut_write=True)
    assert not answer or 400 <= _status(answer) < 500, answer[:300]
    _assert_serving(router)


def test_slow_body_is_408(router):
    start = time.monotonic()
    answer = _raw(router, _head(extra="Content-Length: 1000\r\n"), [b'{"model": "x"'])
    assert _status(answer) == 408, answer[:300]
    assert time.monotonic() - start < TIMEOUT_S + 3
    _assert_serving(router)


@pytest.mark.parametrize("drip", [False, True])
def test_slow_or_missing_headers_are_dropped(router, drip):
    sock = socket.create_connection(("127.0.0.1", _port(router)), timeout=TIMEOUT_S + 5)
    start = time.monotonic()
    try:
        closed = False
        for byte in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" if drip else b""):
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.1)
            if time.monotonic() - start > TIMEOUT_S + 3:
                break
        if not closed:
            try:
                assert sock.recv(1024) == b""  # the server closed it
            except ConnectionResetError:
                pass
    finally:
        sock.close()
    assert time.monotonic() - start < TIMEOUT_S + 3
    _assert_serving(router)


def test_oversized_headers_are_4xx(router):
    answer = _raw(router, (f"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 200_000}\r\n\r\n"
                           ).encode())
    assert not answer or 400 <= _status(answer) < 500, answer[:300]
    _assert_serving(router)


def test_small_request_is_answered_while_bodies_at_the_limit_wait_for_the_workers(model_info):
    """A small body is prepared on the event loop, never behind a heavy one in the prepare
    workers: with every worker stopped (SIGSTOP) and bodies just under the size limit (a text
    past any context, an array of 2M token ids, a chat of many messages) read and waiting for
    them, small requests are answered; once the workers go on, each heavy body gets its 400.
    The router runs as its own process, so that its workers can be stopped."""
    import psutil

    words = json.dumps({"model": MODEL, "prompt": "word " * (LIMIT // 5 - 100)}).encode()
    ids = b'{"model": "%s", "prompt": [' % MODEL.encode() + b"1," * (LIMIT // 2 - 100) + b"1]}"
    chat = json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "word " * 1000}] * (LIMIT // 5035 - 1)}).encode()
    heavy = [words, ids, chat]
    assert all(LIMIT - 8192 < len(b) <= LIMIT for b in heavy), [len(b) for b in heavy]
    engine = ScriptedEngine("normal", model_info.tokenizer.encode(" one two three four"))
    try:
        with router_process("--engine", f"normal={engine.address}") as (url, proc):
            router = psutil.Process(proc.pid)
            workers = [c for c in router.children() if "spawn_main" in " ".join(c.cmdline())]
            assert len(workers) == 2, router.children()  # --prepare-workers' default
            statuses: list[int] = []
            sent: list[int] = []  # the local ports of the heavy connections, once sent
            threads = [threading.Thread(target=_send_and_read, args=(url, b, sent, statuses))
                       for b in heavy]
            for worker in workers:
                worker.suspend()
            try:
                for t in threads:
                    t.start()
                # Every heavy body is sent and the router has read it: they wait for a worker.
                wait_for(lambda: len(sent) == len(heavy) and not any(
                    _unread(_port(url), port) for port in sent), timeout_s=30, poll_s=0.05)
                for _ in range(5):
                    _assert_serving(url)
                assert not statuses and all(t.is_alive() for t in threads)
            finally:
                for worker in workers:
                    worker.resume()
            for t in threads:
                t.join(60)
            assert statuses == [400] * len(heavy), statuses
            _assert_serving(url)
    finally:
        engine.close()


def _send_and_read(url: str, body: bytes, sent: list[int], statuses: list[int]) -> None:
    sock = socket.create_connection(("127.0.0.1", _port(url)), timeout=60)
    try:
        sock.sendall(_head(extra=f"Content-Length: {len(body)}\r\n") + body)
        sent.append(sock.getsockname()[1])
        answer = b""
        while not (b"\r\n\r\n" in answer and _is_complete(answer)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        statuses.append(_status(answer))
    finally:
        sock.close()


def _unread(server_port: int, client_port: int) -> int:
    """Bytes of the loopback connection client_port -> server_port that the server process has
    not read yet: the client's send queue plus the server's receive queue (/proc/net/tcp);
    -1 while either end is not in the table."""
    queued, ends = 0, 0
    with open("/proc/net/tcp") as table:
        for row in list(table)[1:]:
            fields = row.split()
            local, remote = (int(a.split(":")[1], 16) for a in fields[1:3])
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            if (local, remote) == (client_port, server_port):
                queued, ends = queued + tx, ends + 1
            elif (local, remote) == (server_port, client_port):
                queued, ends = queued + rx, ends + 1
    return queued if ends == 2 else -1
