"""A scripted engine for router tests: a real ZMQ ROUTER speaking baton/protocol.py, no model.

It stands in for a model only where the router's own logic is under test (routing, retry,
abort, stop strings, demultiplexing); the end-to-end tests use the real engine processes. It
answers every request with the same canned token ids, one per `delay_s`:
  normal      token_ids[:max_tokens]
  prompt      one delta: token_ids[0] + a KV handle naming this engine (or "length" if max 1)
  completion  token_ids[1:max_tokens], after checking the handle and first token it was given
`mode` "error" answers each request with an error delta; "silent" never answers. A request
with `output_token_ids` (a migration) continues the canned ids after that many; `fail_after`
ends each request with an error delta once this engine has sent that many of its tokens;
`stall_after` goes silent then instead (a hung engine: the router's token timeout). A normal
engine answers each of a request's n choices with the same ids (deltas carrying their index).
`tokens_per_delta` > 1 sends that many tokens a delta (an engine keeping speculative drafts).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import zmq

from baton.protocol import (
    AbortRequest,
    EngineOutputs,
    EngineStats,
    GenerateRequest,
    StatsRequest,
    TokenDelta,
    decode_to_engine,
    encode,
)
from kv_transfer.auth import keys_from_env, stop_authenticator


@dataclass
class _Running:
    identity: bytes
    req: GenerateRequest
    tokens: list[int]
    position: int = 0
    next_at: float = 0.0
    index: int = 0  # the choice (n > 1)


class ScriptedEngine:
    def __init__(self, role: str, token_ids: list[int], delay_s: float = 0.0, mode: str = "ok",
                 name: str = "", port: int = 0, fail_after: int = -1,
                 stall_after: int = -1, tokens_per_delta: int = 1):
        self.role = role
        self.token_ids = token_ids
        self.delay_s = delay_s
        self.mode = mode
        self.name = name or role
        self.fail_after = fail_after
        self.stall_after = stall_after
        self.tokens_per_delta = tokens_per_delta
        self.generates: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.running: dict[str, _Running] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        keys_from_env().apply_server(self._sock, "engine")  # as a real engine: CURVE + ZAP
        if port:  # an engine restarted behind its old address
            self._sock.bind(f"tcp://127.0.0.1:{port}")
        else:
            port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop and close the socket: the router sees the connection drop."""
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        stop_authenticator(self._ctx)
        self._ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(5):
                identity, payload = self._sock.recv_multipart()
                self._handle(identity, decode_to_engine(payload))
            self._emit_due()

    def _handle(self, identity: bytes, msg) -> None:
        if isinstance(msg, StatsRequest):
            self._send(identity, EngineStats(engine_id=self.name, role=self.role, nonce=msg.nonce,
                                             num_running=len(self.running)))
        elif isinstance(msg, AbortRequest):
            self.aborts.append(msg.req_id)
            runs = [self.running.pop(key) for key in list(self.running)
                    if key == msg.req_id or key.startswith(f"{msg.req_id}#")]
            if runs:
                self._send(identity, TokenDelta(msg.req_id, finish_reason="abort"))
        elif isinstance(msg, GenerateRequest):
            self.generates.append(msg)
            self._start(identity, msg)

    def _start(self, identity: bytes, req: GenerateRequest) -> None:
        if self.mode == "silent":
            return
        if self.mode == "error":
            self._send(identity, TokenDelta(req.req_id, finish_reason="error", error="scripted"))
            return
        given = len(req.output_token_ids)
        assert req.output_token_ids == self.token_ids[:given], req.output_token_ids
        if self.role == "prompt":
            done = req.sampling.max_tokens == given + 1
            self._send(identity, TokenDelta(
                req.req_id, token_ids=self.token_ids[given:given + 1], logprobs=[-0.5],
                finish_reason="length" if done else "",
                kv_handle=b"" if done else f"handle:{self.name}".encode(),
                num_prompt_tokens=len(req.prompt_token_ids)))
            return
        tokens = self.token_ids[given:req.sampling.max_tokens]
        if self.role == "completion":
            assert req.kv_handle.startswith(b"handle:"), req.kv_handle
            assert req.first_token_id == self.token_ids[given], req.first_token_id
            tokens = tokens[1:]
        if self.role == "normal" and req.sampling.n > 1:
            for i in range(req.sampling.n):
                self.running[f"{req.req_id}#{i}"] = _Running(identity, req, tokens,
                                                             next_at=time.monotonic(), index=i)
            return
        self.running[req.req_id] = _Running(identity, req, tokens, next_at=time.monotonic())

    def _emit_due(self) -> None:
        now = time.monotonic()
        for key, run in list(self.running.items()):
            req_id = run.req.req_id
            if now < run.next_at:
                continue
            if run.position == self.stall_after:
                continue
            if run.position == self.fail_after:
                del self.running[key]
                self._send(run.identity, TokenDelta(req_id, finish_reason="error",
                                                    error="scripted failure", index=run.index))
                continue
            token = run.tokens[run.position:run.position + self.tokens_per_delta]
            run.position += len(token)
            run.next_at = now + self.delay_s
            finish = ""
            if run.position >= len(run.tokens):
                finish = "length" if len(self.token_ids) >= run.req.sampling.max_tokens else "stop"
                del self.running[key]
            self._send(run.identity, TokenDelta(req_id, token_ids=token, logprobs=[-0.1] * len(token),
                                                finish_reason=finish, index=run.index))

    def _send(self, identity: bytes, msg) -> None:
        if isinstance(msg, TokenDelta):  # engines send their deltas as EngineOutputs
            msg = EngineOutputs([msg])
        self._sock.send_multipart([identity, encode(msg)])
