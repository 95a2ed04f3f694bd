"""A small synchronous client of the engine wire, for the launcher, tests and operators.

The router has its own asyncio client; this one sends a request and waits for replies with a
timeout, over a fresh DEALER socket that is closed before returning. With cluster keys it
dials CURVE (kv_transfer/auth.py); an engine serving CURVE never answers a client without them.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
from collections.abc import Iterator

import zmq

from baton.protocol import (
    AbortRequest,
    ChangeRole,
    ControlReply,
    EngineOutputs,
    EngineStats,
    GenerateRequest,
    ProtocolError,
    ResetPrefixCache,
    SamplingOptions,
    StatsRequest,
    TokenDelta,
    decode_to_router,
    encode,
)
from kv_transfer.auth import ClusterKeys

logger = logging.getLogger(__name__)


class EngineTimeout(TimeoutError):
    """The engine did not answer in time (dead, overloaded, or not an engine)."""


class EngineClient:
    def __init__(self, address: str, ctx: zmq.Context | None = None,
                 keys: ClusterKeys | None = None):
        self.address = address
        self.ctx = ctx or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keys is not None:
            keys.apply_client(self.sock)
        self.sock.connect(address)
        self._inbox: collections.deque[TokenDelta | EngineStats | ControlReply] = \
            collections.deque()

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def send(self, msg: GenerateRequest | AbortRequest | StatsRequest) -> None:
        self.sock.send(encode(msg))

    def recv(self, timeout_s: float) -> TokenDelta | EngineStats | ControlReply:
        """The next delta (an engine's `EngineOutputs` are taken apart) or stats reply."""
        while not self._inbox:
            if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
                raise EngineTimeout(f"no reply from {self.address} within {timeout_s}s")
            msg = decode_to_router(self.sock.recv())
            self._inbox.extend(msg.outputs if isinstance(msg, EngineOutputs) else [msg])
        return self._inbox.popleft()

    def stats(self, timeout_s: float = 5.0) -> EngineStats:
        return self._ask(StatsRequest, EngineStats, timeout_s)

    def reset_prefix_cache(self, timeout_s: float = 5.0, pool_only: bool = False,
                           shared: bool = False) -> ControlReply:
        """Forget the engine's cached-free blocks, and its disk tier's unless `pool_only`;
        `shared`: the shared tier's blocks of its fingerprint too."""
        return self._ask(lambda nonce: ResetPrefixCache(nonce, pool_only, shared), ControlReply,
                         timeout_s)

    def change_role(self, role: str, timeout_s: float = 5.0) -> ControlReply:
        """Ask the engine to become `role` (S41): accepted (it drains, then switches) or
        refused with the reason; `stats().role` says when it is done."""
        return self._ask(lambda nonce: ChangeRole(role, nonce), ControlReply, timeout_s)

    def _ask(self, request_type, reply_type, timeout_s: float):
        """Send a request carrying a fresh nonce; its reply (other messages are skipped)."""
        nonce = uuid.uuid4().int & 0x7FFFFFFF
        self.send(request_type(nonce))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            if isinstance(msg, reply_type) and msg.nonce == nonce:
                return msg

    def stream(self, req: GenerateRequest, timeout_s: float = 60.0) -> Iterator[TokenDelta]:
        """Yields the request's deltas until one carries a finish reason or a KV handle (a
        prompt engine's only answer)."""
        self.send(req)
        while True:
            msg = self.recv(timeout_s)
            if isinstance(msg, TokenDelta) and msg.req_id == req.req_id:
                yield msg
                if msg.finish_reason or msg.kv_handle:
                    return

    def generate(self, prompt_token_ids: list[int], sampling: SamplingOptions,
                 req_id: str | None = None, timeout_s: float = 60.0, **fields) -> TokenDelta:
        """All deltas of one request merged into one (token ids, logprobs, finish reason)."""
        req = GenerateRequest(req_id or uuid.uuid4().hex, list(prompt_token_ids), sampling,
                              **fields)
        merged = TokenDelta(req.req_id)
        for delta in self.stream(req, timeout_s):
            merged.token_ids += delta.token_ids
            merged.logprobs += delta.logprobs
            merged.finish_reason, merged.error = delta.finish_reason, delta.error
            merged.kv_handle = delta.kv_handle or merged.kv_handle
            merged.num_prompt_tokens = delta.num_prompt_tokens or merged.num_prompt_tokens
            merged.num_cached_tokens = delta.num_cached_tokens or merged.num_cached_tokens
        return merged


def probe_engine(address: str, timeout_s: float = 1.0,
                 keys: ClusterKeys | None = None) -> EngineStats | None:
    """The engine's stats, or None when it does not answer within the timeout (a CURVE engine
    never answers a probe without the cluster keys) or what answers is not an engine (another
    service took the port: the probe says "no engine here", it does not raise)."""
    with EngineClient(address, keys=keys) as client:
        try:
            return client.stats(timeout_s)
        except EngineTimeout:
            return None
        except ProtocolError as exc:
            logger.warning("%s answers, but not as an engine: %s", address, exc)
            return None


def is_whole(stats: EngineStats) -> bool:
    """An engine's pool as after a drain: every block free, nothing running or queued, no KV
    lease or pull left (what tests and the soak check when the load is over)."""
    return (stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0
            and stats.num_waiting == 0 and stats.extra.get("kv_leases_active", 0) == 0
            and stats.extra.get("kv_pulls_active", 0) == 0)
