"""Router <-> engine wire: one protocol for the three engine roles.

The router holds a ZMQ DEALER per engine; every engine (NORMAL, PROMPT, COMPLETION) binds a
ROUTER socket and speaks these messages, msgpack-encoded with msgspec. New fields go at the end.

    router -> engine   GenerateRequest | AbortRequest | StatsRequest | ResetPrefixCache
                       | SubscribeKvEvents | ChangeRole | LoadLoraAdapter | UnloadLoraAdapter
    engine -> router   EngineOutputs   | EngineStats  | ControlReply | KvEvents

An engine sends one `EngineOutputs` per step per router connection, carrying a `TokenDelta` for
every request of that router the step touched (vLLM's `EngineCoreOutputs`): at batch 64 one
message a step instead of 64. Token ids only: the router detokenizes.

The KV handle is opaque here: the prompt engine encodes it (kv_transfer.protocol), the router
only carries the bytes from one engine to the other, and the completion engine decodes and
checks it.
"""

from __future__ import annotations

import sys
from array import array
from typing import Annotated

import msgspec

# A single message larger than this is refused before decoding: the longest legal message is a
# prompt of max_model_len token ids, far below it.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (and vLLM's default on logprobs)
# The engine roles, as engines publish them (registry records) and the router names them.
NORMAL, PROMPT, COMPLETION = "normal", "prompt", "completion"
ROLES = (NORMAL, PROMPT, COMPLETION)
MAX_CHOICES = 128  # the most choices (n) one request may ask of an engine
MAX_CACHE_SALT_CHARS = 256  # a cache salt is an opaque tenant tag, not a document
MAX_REQ_ID_CHARS = 512  # the router's ids are < 100 characters (a uuid, a migration suffix)
MAX_LORA_NAME_CHARS = 128  # a LoRA adapter's name (baton/model/lora.py checks its characters)
MAX_PATH_CHARS = 4096  # a LoRA adapter's folder (PATH_MAX)

# Bounds checked while decoding (a message that breaks one is a ProtocolError, dropped): the
# fields an engine uses before its request validation runs (a dict key, a set of choices).
ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQ_ID_CHARS)]
NumChoices = Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)]
CacheSalt = Annotated[str, msgspec.Meta(max_length=MAX_CACHE_SALT_CHARS)]
LoraName = Annotated[str, msgspec.Meta(max_length=MAX_LORA_NAME_CHARS)]


class SamplingOptions(msgspec.Struct, array_like=True, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}  # token id -> bias in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked before this many outputs
    min_p: float = 0.0
    sample_index: int = 0  # which choice of the request (n > 1): part of a seeded draw
    # The most likely tokens (id, logprob) beside each sampled one, 0-20 (OpenAI's
    # top_logprobs); needs `logprobs`.
    top_logprobs: int = 0
    # Echo: the prompt's own token logprobs (and this many alternatives each), computed while
    # prefilling; -1 = not asked. The prompt then skips the prefix cache (no logits there).
    prompt_logprobs: int = -1
    # Structured output: an llguidance grammar (serialized; baton/engine/grammar.py) every sampled
    # token must follow; "" = none. Such a request is never recomputed after a preemption.
    grammar: str = ""
    # Choices of the prompt (OpenAI's n): one prefill, n first tokens (choice i draws with
    # sample_index + i), then n forks of one sequence sharing the prompt's KV blocks.
    n: NumChoices = 1
    # False: the engine verifies no drafts for this request (speculative decoding off for it;
    # the tokens are the same, only the speed differs).
    speculative: bool = True


class GenerateRequest(msgspec.Struct, tag="gen", array_like=True, omit_defaults=True):
    req_id: ReqId
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    # COMPLETION role only: where the prompt's KV lies, and the token the prompt engine sampled.
    kv_handle: bytes = b""
    first_token_id: int = -1
    first_logprob: float = 0.0
    # A migrated request (its engine failed mid-stream): the outputs the router already has.
    # The engine prefills prompt + these and counts them as outputs (max_tokens, min_tokens,
    # penalties, a seed's position); a KV handle then covers prompt + these.
    output_token_ids: list[int] = []
    # COMPLETION role with sampling.n > 1: the choices that go on here (those the prompt
    # engine's first token did not finish) and each one's first token and its logprob;
    # first_token_id is first_token_ids[0]. Empty: the one choice 0.
    choice_indices: Annotated[list[int], msgspec.Meta(max_length=MAX_CHOICES)] = []
    first_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_CHOICES)] = []
    first_logprobs: Annotated[list[float], msgspec.Meta(max_length=MAX_CHOICES)] = []
    # A tenant's tag (vLLM's cache_salt): its prompt blocks are keyed from its own seed
    # (baton/engine/block_keys.py), so they hit only that tenant's cached blocks. "" = shared.
    cache_salt: CacheSalt = ""
    # The LoRA adapter the request runs with (the OpenAI request's `model` when it names one);
    # "" = the base model. It keys the prompt's blocks too (baton/engine/block_keys.py), and a
    # completion engine serves a handed-off prompt only with the same adapter loaded.
    lora_name: LoraName = ""


class AbortRequest(msgspec.Struct, tag="abort", array_like=True, omit_defaults=True):
    req_id: ReqId


class StatsRequest(msgspec.Struct, tag="stats?", array_like=True, omit_defaults=True):
    nonce: int = 0


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True,
                       omit_defaults=True):
    """Forget every cached-free KV block (vLLM's `/reset_prefix_cache`), and every block of
    the engine's lower tiers (its disk) unless `pool_only`; `shared`: the shared tier's blocks
    of its fingerprint too (every engine's, docs/scheduler.md P11)."""

    nonce: int = 0
    pool_only: bool = False
    shared: bool = False


class ChangeRole(msgspec.Struct, tag="change_role", array_like=True, omit_defaults=True):
    """Become `role` without a restart (the planner's verb): stop taking new work, drain, switch
    the scheduler's mode over the same weights and KV pool, re-register (docs/scheduler.md
    S41). Answered at once by a `ControlReply`: accepted (the change runs) or refused, why."""

    role: Annotated[str, msgspec.Meta(max_length=32)]
    nonce: int = 0


class LoadLoraAdapter(msgspec.Struct, tag="load_lora", array_like=True, omit_defaults=True):
    """Load the PEFT LoRA adapter in folder `lora_path` under `lora_name` (vLLM's
    /v1/load_lora_adapter); answered by a `ControlReply` (refused: why, naming the adapter)."""

    lora_name: LoraName
    lora_path: Annotated[str, msgspec.Meta(max_length=MAX_PATH_CHARS)]
    nonce: int = 0


class UnloadLoraAdapter(msgspec.Struct, tag="unload_lora", array_like=True,
                        omit_defaults=True):
    """Unload adapter `lora_name` (vLLM's /v1/unload_lora_adapter); a `ControlReply`."""

    lora_name: LoraName
    nonce: int = 0


class ControlReply(msgspec.Struct, tag="control", array_like=True, omit_defaults=True):
    """The answer to a control request (`ResetPrefixCache`, `ChangeRole`, `LoadLoraAdapter`,
    `UnloadLoraAdapter`), matched by nonce."""

    nonce: int
    ok: bool
    message: str = ""


class SubscribeKvEvents(msgspec.Struct, tag="kv_subscribe", array_like=True,
                        omit_defaults=True):
    """Cache-aware routing: send this connection the prefix-cache keys the engine holds, a
    snapshot now and then a `KvEvents` delta after every iteration that changed them."""

    nonce: int = 0


class KvEvents(msgspec.Struct, tag="kv_events", array_like=True, omit_defaults=True):
    """Block keys that entered (`stored`) or left (`removed`) an engine's prefix cache.

    Keys are packed little-endian uint64 (8 bytes each). A snapshot replaces everything the
    subscriber knew of this engine; a delta has `seq` one past the previous message, so a gap
    (a message the socket dropped) or a new `instance_id` (a restarted engine) tells the router
    to forget the engine's keys and subscribe again.
    """

    instance_id: str
    seq: int
    is_snapshot: bool = False
    stored: bytes = b""
    removed: bytes = b""
    nonce: int = 0  # a snapshot answers the SubscribeKvEvents of this nonce
    block_size: int = 0  # tokens per block and the key chain's seed: the router keys a prompt
    seed: int = 0  # with the same function (baton.scheduler.compute_block_keys)
    num_total_blocks: int = 0  # no engine holds more keys than this
    # The disk tier's keys (docs/scheduler.md P10), packed as `stored`: what entered / left it
    # (a snapshot: all it holds); a key may be in both tiers.
    disk_stored: bytes = b""
    disk_removed: bytes = b""
    num_disk_blocks: int = 0  # the disk tier holds no more keys than this (0: no disk tier)
    # The shared cluster tier's keys (docs/scheduler.md P11) as this engine knows them (it wrote
    # or read them), packed as `stored`; every engine of one `shared_tier` id reaches them all.
    shared_stored: bytes = b""
    shared_removed: bytes = b""
    num_shared_blocks: int = 0  # this engine names no more shared keys than this
    shared_tier: str = ""  # the store and the fingerprint's namespace ("": no shared tier)


class TokenDelta(msgspec.Struct, tag="delta", array_like=True, omit_defaults=True):
    """New tokens of one request; the last delta of a request carries its finish reason.

    A PROMPT engine answers with one delta: the first token, and, unless the request already
    finished, the KV handle for the completion engine.
    """

    req_id: str
    token_ids: list[int] = []
    logprobs: list[float] = []
    finish_reason: str = ""  # "" while running; stop, length, abort, kv_transfer_failed, ...
    kv_handle: bytes = b""
    error: str = ""  # a human-readable reason when finish_reason is an error
    num_prompt_tokens: int = 0
    # On a request's first token: prompt tokens the engine took from its prefix cache instead
    # of computing them (the client's usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
    # With SamplingOptions.top_logprobs: per token of token_ids, the most likely ids and
    # their logprobs (the model's distribution, best first).
    top_token_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    # With SamplingOptions.prompt_logprobs, on the first delta: the logprob of each prompt
    # token after the first (whose has no context), and the alternatives at each position.
    prompt_logprobs: list[float] = []
    prompt_top_token_ids: list[list[int]] = []
    prompt_top_logprobs: list[list[float]] = []
    # Which choice (n > 1) the tokens and finish reason are for. A request ends when each of
    # its choices has a finish reason; an error or abort reason ends all of them at once.
    index: int = 0


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True):
    """What one engine step (or one incoming message) produced for one router connection."""

    outputs: list[TokenDelta] = []


class EngineStats(msgspec.Struct, tag="stats", array_like=True, omit_defaults=True):
    engine_id: str
    role: str
    nonce: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_requests_finished: int = 0
    healthy: bool = True
    draining: bool = False
    extra: dict[str, float] = {}
    # The LoRA adapters it serves: name -> id (what a router without a registry learns them
    # from; with one, the engine's record carries the same).
    lora_adapters: dict[str, str] = {}


RouterToEngine = (GenerateRequest | AbortRequest | StatsRequest | ResetPrefixCache
                  | SubscribeKvEvents | ChangeRole | LoadLoraAdapter | UnloadLoraAdapter)
EngineToRouter = EngineOutputs | EngineStats | ControlReply | KvEvents

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(RouterToEngine)
_to_router = msgspec.msgpack.Decoder(EngineToRouter)


class ProtocolError(ValueError):
    """A message from a socket that is too large or does not decode: never trusted."""


def pack_keys(keys) -> bytes:
    """uint64 block keys (a numpy array or a sequence of ints) -> KvEvents bytes."""
    return array("Q", keys).tobytes() if sys.byteorder == "little" else _swapped(array("Q", keys))


def unpack_keys(data: bytes, max_keys: int) -> array:
    """KvEvents bytes -> uint64 keys; ProtocolError if the length is not whole keys or
    exceeds `max_keys`."""
    if len(data) % 8:
        raise ProtocolError(f"{len(data)} key bytes are not a whole number of uint64 keys")
    if len(data) // 8 > max_keys:
        raise ProtocolError(f"{len(data) // 8} keys exceed the bound of {max_keys}")
    keys = array("Q")
    keys.frombytes(data)
    if sys.byteorder != "little":
        keys.byteswap()
    return keys


def _swapped(keys: array) -> bytes:
    keys.byteswap()
    return keys.tobytes()


def encode(msg: RouterToEngine | EngineToRouter) -> bytes:
    return _encoder.encode(msg)


def decode_to_engine(data: bytes) -> RouterToEngine:
    return _decode(_to_engine, data)


def decode_to_router(data: bytes) -> EngineToRouter:
    return _decode(_to_router, data)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes):
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable message: {exc}") from exc
