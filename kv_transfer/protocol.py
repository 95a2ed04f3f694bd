"""Wire types of the KV side channel (ZMQ) and of the NIXL release note.

The prompt engine's exporter serves a ZMQ ROUTER socket; each completion engine's importer
talks to it through one DEALER per peer. Every message is a tagged, array-like msgspec Struct,
so a frame is a short msgpack array whose first item names the type. New fields go at the end.

    importer                         exporter
    Handshake(seq)          ->
                            <-       HandshakeReply(seq, instance, agent metadata, pool shape,
                                                    fingerprint)
    Claim(seq, request, instance, agent, block ids, credential) ->
                            <-       ClaimReply(seq, request, ok | reason)
    NIXL READ of the claimed blocks, carrying the notification Release(request, instance)
"""

from __future__ import annotations

import msgspec

# Bumped whenever a message changes shape; part of the fingerprint, so two engines
# that would misread each other refuse to talk instead of corrupting a transfer. It is the KV
# wire's own version, not the Baton release's: kv_transfer depends on nothing in baton.
# 2: the lease credential in KVHandle and Claim; 3: block checksums in KVHandle, the weights and
# the key scheme in the Fingerprint.
PROTOCOL_VERSION = 3


class Fingerprint(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """What must match for two engines' KV blocks to be interchangeable byte for byte: the one
    definition, checked at the hand-off's handshake and (later) by every tier that keeps
    blocks (kv_transfer/integrity.py)."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = "block-major:[blocks,layers,2,block_size,kv_heads,head_dim]"
    version: str = f"kv-{PROTOCOL_VERSION}"
    # Identity of the weights that computed the blocks (a digest of the weight files and the
    # quantization): two files under one name compute other K/V.
    weights: str = ""
    # The prefix-cache key chain's seed, hex: pools whose keys name blocks differently must
    # not share them by key.
    key_scheme: str = ""

    def describe(self) -> str:
        return (
            f"{self.model}/{self.dtype}/L{self.num_layers}/H{self.num_kv_heads}"
            f"/D{self.head_dim}/B{self.block_size}/{self.layout}/{self.version}"
            f"/W{self.weights[:12] or '-'}/K{self.key_scheme or '-'}"
        )


class KVHandle(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """What the prompt engine returns to the router: where the prompt's KV lies and under which
    lease. The router passes it unchanged to the completion engine."""

    engine_id: str
    side_channel: str  # "tcp://host:port" of the exporter's ROUTER socket
    instance_id: str  # the exporter process's start id; a restart invalidates old handles
    request_id: str
    block_ids: list[int]
    num_tokens: int
    # Prefix-cache keys of the prompt's full blocks (a hash chain over their tokens, seeded
    # with the model fingerprint): a completion engine holding some of them pulls only the rest.
    block_keys: list[int] = []
    # The lease's single-use secret (16 random bytes): only a claim carrying it is granted. It
    # reaches the completion engine inside this handle, over the CURVE-encrypted engine wires.
    credential: bytes = b""
    # CRC-32 of each block in block_ids (kv_transfer/integrity.py), taken when the lease began;
    # empty when the exporter's checksum policy skipped this prompt. The importer verifies the
    # blocks it pulled against them before the request may decode.
    checksums: list[int] = []


class Handshake(msgspec.Struct, tag="hs", array_like=True, omit_defaults=True):
    seq: int


class HandshakeReply(msgspec.Struct, tag="hs_ok", array_like=True, omit_defaults=True):
    seq: int
    engine_id: str
    instance_id: str
    agent_name: str
    agent_metadata: bytes
    base_address: int
    num_blocks: int
    block_bytes: int
    fingerprint: Fingerprint
    # Where the pool lives (kv_transfer.config.MEM_TYPES): a GPU pool is read as NIXL VRAM.
    mem_type: str = "DRAM"
    device_id: int = 0


class Claim(msgspec.Struct, tag="claim", array_like=True, omit_defaults=True):
    seq: int
    request_id: str
    instance_id: str
    agent_name: str  # the importer's NIXL agent: only it may release the lease
    block_ids: list[int]
    credential: bytes = b""  # the handle's lease credential


class ClaimReply(msgspec.Struct, tag="claim_ok", array_like=True, omit_defaults=True):
    seq: int
    request_id: str
    ok: bool
    reason: str = ""  # a FailReason value when not ok
    message: str = ""


class ErrorReply(msgspec.Struct, tag="err", array_like=True, omit_defaults=True):
    """Answer to a frame the exporter could not decode: seq is -1 when unknown."""

    seq: int
    message: str


class Release(msgspec.Struct, tag="rel", array_like=True, omit_defaults=True):
    """NIXL notification payload: the importer is done with the lease (read or gave up)."""

    request_id: str
    instance_id: str


ToExporter = Handshake | Claim
ToImporter = HandshakeReply | ClaimReply | ErrorReply

_encoder = msgspec.msgpack.Encoder()
_to_exporter = msgspec.msgpack.Decoder(ToExporter)
_to_importer = msgspec.msgpack.Decoder(ToImporter)
_release = msgspec.msgpack.Decoder(Release)
_handle = msgspec.msgpack.Decoder(KVHandle)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode_to_exporter(data: bytes) -> Handshake | Claim:
    return _to_exporter.decode(data)


def decode_to_importer(data: bytes) -> HandshakeReply | ClaimReply | ErrorReply:
    return _to_importer.decode(data)


def decode_release(data: bytes) -> Release:
    return _release.decode(data)


def decode_handle(data: bytes) -> KVHandle:
    return _handle.decode(data)
