"""The disk tier's files: segments of KV blocks, the index rebuilt from them, LRU by file.

```
DIR/seg-<ns>-<n>.kvd    one segment, appended to by the writer thread, closed at segment_bytes
  MAGIC | u32 len | Fingerprint (msgpack)        who produced every block in the file
  record*: u64 key | u64 parent | u32 checksum | u32 nbytes | i32 tokens[block_size] | bytes
```
A record's checksum is `kv_transfer.integrity.checksum` of its block bytes (the hand-off's),
the file's fingerprint `kv_transfer.protocol.Fingerprint` (the hand-off's): a block is used only
when both match and its key is the chain hash of its parent and tokens, and those tokens are
the prompt's. Anything else is a miss, counted in `num_integrity_failures`.

Eviction is by file, least recently used first (a hit touches its file, mtime included, so the
order survives a restart), whenever the files would pass `budget_bytes`. One lock guards the
index: the writer adds, the reader and the engine's thread look up, either may remove.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np

from baton.engine.block_keys import compute_block_keys
from baton.engine.kv_tier import KeyLedger
from kv_transfer.integrity import checksum, fingerprint_mismatch
from kv_transfer.protocol import Fingerprint

logger = logging.getLogger(__name__)

MAGIC = b"BATONKV1"
RECORD = struct.Struct("<QQII")  # key, parent, checksum, block bytes; then the tokens
SUFFIX = ".kvd"
MAX_HEADER_BYTES = 1 << 16  # a fingerprint's msgpack is a few hundred bytes
COLLISION = "tokens"  # check_record's reason for a key whose tokens are another prompt's


def fingerprint_header(fingerprint: Fingerprint) -> bytes:
    """MAGIC | u32 len | the fingerprint (msgpack): what opens a segment file, and every value
    of the shared tier (baton/engine/kv_shared.py)."""
    body = msgspec.msgpack.encode(fingerprint)
    return MAGIC + struct.pack("<I", len(body)) + body


def parse_fingerprint(body: bytes) -> Fingerprint | None:
    try:
        return msgspec.msgpack.decode(body, type=Fingerprint)
    except msgspec.DecodeError:
        return None


def split_header(raw: bytes) -> tuple[Fingerprint | None, int]:
    """The fingerprint a value opens with and where its record starts (None: no header)."""
    if len(raw) < len(MAGIC) + 4 or raw[:len(MAGIC)] != MAGIC:
        return None, 0
    (size,) = struct.unpack_from("<I", raw, len(MAGIC))
    end = len(MAGIC) + 4 + size
    if size > MAX_HEADER_BYTES or end > len(raw):
        return None, 0
    return parse_fingerprint(raw[len(MAGIC) + 4:end]), end


def encode_record(key: int, parent: int, tokens: np.ndarray, block: np.ndarray) -> bytes:
    """One block: its key, its parent's key, the checksum of its bytes, its tokens, its bytes."""
    return (RECORD.pack(key, parent, checksum(block), block.nbytes)
            + np.ascontiguousarray(tokens, dtype="<i4").tobytes() + block.tobytes())


def check_record(raw, key: int, tokens: np.ndarray, block_bytes: int) -> tuple[np.ndarray, str]:
    """The block bytes of record `raw` for `key` and its `tokens`, and "" when every check
    passes, else why not: "record header" (length, key, or a key that is not the chain hash
    of its parent and tokens), COLLISION (another prompt's tokens), "checksum"."""
    block_size = len(tokens)
    if len(raw) != RECORD.size + 4 * block_size + block_bytes:
        return np.empty(0, np.uint8), "record header"
    got_key, parent, crc, nbytes = RECORD.unpack_from(raw)
    held = np.frombuffer(raw, dtype="<i4", count=block_size, offset=RECORD.size)
    block = np.frombuffer(raw, dtype=np.uint8, offset=RECORD.size + 4 * block_size)
    chained = compute_block_keys(held, block_size, parent)
    if got_key != key or nbytes != block_bytes or int(chained[0]) != key:
        return block, "record header"
    if not np.array_equal(held, tokens):
        return block, COLLISION
    if checksum(block) != crc:
        return block, "checksum"
    return block, ""


@dataclass(eq=False)
class Segment:
    path: Path
    nbytes: int = 0
    last_used: float = 0.0  # time.time() of its last write or hit
    usable: bool = True  # False: another producer's file (fingerprint), nothing indexed
    keys: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Entry:
    segment: Segment
    offset: int  # of the record


class DiskStore:
    """Segment files under `directory`, at most `budget_bytes` together."""

    def __init__(self, directory: str | Path, budget_bytes: int, fingerprint: Fingerprint,
                 block_bytes: int, segment_bytes: int = 64 << 20) -> None:
        self.directory = Path(directory)
        self.budget_bytes = int(budget_bytes)
        self.fingerprint = fingerprint
        self.block_size = fingerprint.block_size
        self.block_bytes = int(block_bytes)
        self.record_bytes = RECORD.size + 4 * self.block_size + self.block_bytes
        self.header = self._header(fingerprint)
        # At least one record, at most an eighth of the budget (LRU by file stays fine-grained).
        self.segment_bytes = max(len(self.header) + self.record_bytes,
                                 min(segment_bytes, self.budget_bytes // 8))
        self.lock = threading.Lock()
        self.index: dict[int, Entry] = {}
        self.segments: list[Segment] = []  # least recently used first
        self._open: Segment | None = None
        self._fd = -1
        self._serial = 0
        self.num_integrity_failures = 0
        self.events = KeyLedger(self.lock)  # keys that entered / left since the last drain

    @staticmethod
    def _header(fingerprint: Fingerprint) -> bytes:
        return fingerprint_header(fingerprint)

    @property
    def num_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    @property
    def capacity_blocks(self) -> int:
        return max(1, self.budget_bytes // self.record_bytes)

    # ------------------------------------------------------------------ start-up
    def open(self) -> None:
        """Create the directory, index every segment found (a restart), oldest first; OSError
        when the directory cannot be made or written."""
        self.directory.mkdir(parents=True, exist_ok=True)
        probe = self.directory / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        found = sorted(self.directory.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in found:
            self._scan(path)
        self.events.drain()  # the snapshot names them; nothing "entered" since
        self._enforce_budget(0)

    def _scan(self, path: Path) -> None:
        seg = Segment(path, path.stat().st_size, path.stat().st_mtime)
        try:
            with open(path, "rb") as f:
                theirs = self._read_header(f)
                seg.usable = theirs is not None and not fingerprint_mismatch(self.fingerprint,
                                                                             theirs)
                while seg.usable:
                    offset = f.tell()
                    head = f.read(RECORD.size)
                    if len(head) < RECORD.size:
                        break
                    key, _parent, _crc, nbytes = RECORD.unpack(head)
                    if nbytes != self.block_bytes or offset + self.record_bytes > seg.nbytes:
                        break  # a torn tail (a crash mid-write): the rest is not indexed
                    f.seek(offset + self.record_bytes)
                    if key not in self.index:
                        self.index[key] = Entry(seg, offset)
                        seg.keys.append(key)
        except OSError as exc:
            logger.warning("KV disk tier: cannot read %s (%s); leaving it out", path, exc)
            return
        if not seg.usable:
            self.num_integrity_failures += 1
            why = (fingerprint_mismatch(self.fingerprint, theirs) if theirs is not None
                   else "no readable header")
            logger.warning("KV disk tier: %s was written by another producer (%s); its blocks "
                           "are never used and it goes first", path, why)
            seg.last_used = 0.0
        self.segments.append(seg)

    def _read_header(self, f) -> Fingerprint | None:
        head = f.read(len(MAGIC) + 4)
        if len(head) < len(MAGIC) + 4 or head[:len(MAGIC)] != MAGIC:
            return None
        (size,) = struct.unpack("<I", head[len(MAGIC):])
        return parse_fingerprint(f.read(min(size, MAX_HEADER_BYTES)))

    # ------------------------------------------------------------------ look-ups
    def run_length(self, keys: Sequence[int], start: int) -> int:
        """How many of keys[start:], from the first, are on disk."""
        n = 0
        with self.lock:
            while start + n < len(keys) and int(keys[start + n]) in self.index:
                n += 1
        return n

    def has(self, key: int) -> bool:
        return key in self.index

    # ------------------------------------------------------------------ the writer's side
    def append(self, keys: np.ndarray, parents: np.ndarray, tokens: np.ndarray,
               data: np.ndarray) -> int:
        """Write blocks not on disk yet, in one sequential write per segment; how many were
        written. OSError (full disk, I/O error) leaves the index as it was."""
        with self.lock:
            todo = [i for i, k in enumerate(keys.tolist()) if k not in self.index]
        if not todo or self.budget_bytes < len(self.header) + self.record_bytes:
            return 0
        written = 0
        while todo:
            seg = self._segment()
            room = max(1, (self.segment_bytes - seg.nbytes) // self.record_bytes)
            part, todo = todo[:room], todo[room:]
            self._enforce_budget(len(part) * self.record_bytes)
            buf = bytearray()
            for i in part:
                buf += encode_record(int(keys[i]), int(parents[i]), tokens[i], data[i])
            try:
                done = os.write(self._fd, buf)  # one write per batch: sequential on the device
            except OSError:
                self._close_open()
                raise
            if done < len(buf):  # a full disk mid-write: the torn tail is never indexed
                with self.lock:
                    seg.nbytes += done
                self._close_open()
                raise OSError(errno.ENOSPC, f"short write ({done} of {len(buf)} bytes)")
            with self.lock:
                for j, i in enumerate(part):
                    key = int(keys[i])
                    if key not in self.index:
                        self.index[key] = Entry(seg, seg.nbytes + j * self.record_bytes)
                        seg.keys.append(key)
                        self.events.note(key, stored=True)
                seg.nbytes += len(buf)
                seg.last_used = time.time()
            written += len(part)
            if seg.nbytes + self.record_bytes > self.segment_bytes:
                self._close_open()
        return written

    def _segment(self) -> Segment:
        if self._open is None:
            self._serial += 1
            path = self.directory / f"seg-{time.time_ns():020d}-{self._serial:04d}{SUFFIX}"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            try:
                os.write(fd, self.header)
            except OSError:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise
            seg = Segment(path, len(self.header), time.time())
            with self.lock:
                self.segments.append(seg)
            self._open, self._fd = seg, fd
        return self._open

    def _close_open(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._open, self._fd = None, -1

    def _enforce_budget(self, incoming: int) -> None:
        """Delete least recently used files until `incoming` more bytes fit the budget."""
        while True:
            with self.lock:
                over = self.num_bytes + incoming - self.budget_bytes
                victims = [s for s in self.segments if s is not self._open]
                if over <= 0 or not victims:
                    return
                victim = min(victims, key=lambda s: s.last_used)
            self.remove_segment(victim)

    def remove_segment(self, seg: Segment) -> None:
        with self.lock:
            if seg in self.segments:
                self.segments.remove(seg)
            for key in seg.keys:
                entry = self.index.get(key)
                if entry is not None and entry.segment is seg:
                    del self.index[key]
                    self.events.note(key, stored=False)
            if seg is self._open:
                self._close_open()
        try:
            seg.path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("KV disk tier: cannot delete %s: %s", seg.path, exc)

    def forget_all(self) -> None:
        """Index nothing any more (the writer deletes the files next: `clear`)."""
        with self.lock:
            for key in self.index:
                self.events.note(key, stored=False)
            self.index.clear()

    def clear(self) -> None:
        """Every file goes (the writer's open one too: call on the writer's thread)."""
        for seg in list(self.segments):
            self.remove_segment(seg)

    # ------------------------------------------------------------------ the reader's side
    def read(self, keys: Sequence[int], tokens: np.ndarray,
             deadline: float = float("inf")) -> np.ndarray:
        """Blocks for `keys` (their tokens `tokens[n, block_size]`), as far as every check
        passes and time.monotonic() is before `deadline`: uint8 `[r, block_bytes]`, r <= n.
        A block refused (bytes, producer, key or tokens) is dropped from the index and
        counted; the run stops there."""
        out = np.empty((len(keys), self.block_bytes), dtype=np.uint8)
        fds: dict[Path, int] = {}
        n = 0
        try:
            for n, key in enumerate(keys):  # noqa: B007 (n is the run's length after a break)
                if time.monotonic() > deadline:
                    break
                with self.lock:
                    entry = self.index.get(int(key))
                if entry is None or not self._read_one(entry, int(key), tokens[n], out[n], fds):
                    break
            else:
                n = len(keys)
        finally:
            for fd in fds.values():
                os.close(fd)
        return out[:n]

    def _read_one(self, entry: Entry, key: int, tokens: np.ndarray, dst: np.ndarray,
                  fds: dict[Path, int]) -> bool:
        seg = entry.segment
        try:
            fd = fds.get(seg.path)
            if fd is None:
                fd = fds[seg.path] = os.open(seg.path, os.O_RDONLY)
                with os.fdopen(os.dup(fd), "rb") as f:
                    theirs = self._read_header(f)
                if theirs is None or fingerprint_mismatch(self.fingerprint, theirs):
                    self._refuse(entry, key, f"producer {theirs.describe() if theirs else '?'}")
                    return False
            raw = os.pread(fd, self.record_bytes, entry.offset)
        except OSError as exc:
            logger.warning("KV disk tier: read of %s failed (%s): recomputing", seg.path, exc)
            self._forget(key, entry)
            return False
        if len(raw) < self.record_bytes:
            self._refuse(entry, key, "torn record")
            return False
        block, why = check_record(raw, key, tokens, self.block_bytes)
        if why == COLLISION:
            self._forget(key, entry)  # a 64-bit key collision: not corrupt, just not ours
        elif why:
            self._refuse(entry, key, why)
        else:
            dst[:] = block
            with self.lock:
                seg.last_used = time.time()
            try:
                os.utime(seg.path)
            except OSError:
                pass
            return True
        return False

    def _refuse(self, entry: Entry, key: int, why: str) -> None:
        self.num_integrity_failures += 1
        logger.warning("KV disk tier: block %016x in %s refused (%s): recomputing", key,
                       entry.segment.path.name, why)
        self._forget(key, entry)

    def _forget(self, key: int, entry: Entry) -> None:
        with self.lock:
            if self.index.get(key) == entry:
                del self.index[key]
                self.events.note(key, stored=False)

    # ------------------------------------------------------------------ KV events
    def keys(self) -> list[int]:
        with self.lock:
            return list(self.index)
