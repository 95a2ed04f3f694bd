"""The load cache's torch-free half: where cache files live, what keys them, how they are
written, and the tokenizer's cached form (the router reads it without torch or GGUF parsing).

A model file is parsed once per (file, loader code, dtype, quantization): the engine's loader
(`baton/model/load_cache.py`) writes what it produced to a cache file and later starts map it.
The key:

    weights      the file's identity: size, mtime and blake2b of its first and last MiB (each
                 file of an HF folder); hashing every byte of the default 98 MB GGUF took
                 0.57 s at load 9 on this 2-core host, a tenth of the 5 s restart target,
                 and grows with the model (a 7 GB file: ~40 s)
    loader       blake2b of the source of the code that shapes what a load produces
                 (baton/model/, baton/tokenizer.py, baton/model_files.py, this module): any
                 edit there is a new key, so a stale cache is never read
    dtype, quantization (the engine's cache only; the tokenizer's does not depend on them)

Each file holds its key and checksums of its payload (`checksum`, `bulk_checksum`); a file whose key differs, or whose bytes
do not match their checksums, is a miss (a warning), rebuilt, never used. Writers write a
temporary file beside the final one, fsync it and rename it over: two engines starting at once
both write whole files, and a reader sees one of them or none. A directory keeps the
most recently used model files that fit in `KEEP_MODEL_BYTES` (a budget in bytes, not a count:
the test suite's tiny checkpoints once pushed the default model's 540 MB files out, and every
run's first engines parsed the GGUF again) and `KEEP_TOKENIZER_FILES` tokenizers. Engines that
miss together (a fleet starting) take turns on a lock per file (`miss_lock`): the first parses
and writes, the others then read its file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from baton.model_files import default_model_path

logger = logging.getLogger(__name__)

LOAD_CACHE_ENV = "BATON_LOAD_CACHE_DIR"
# What a cache directory keeps, the most recently used first (a hit touches its file): model
# files up to this many bytes (the newest always; the default model's files are 540 MB exact
# and 636 MB int4, and an edit of the loader code keys every model anew), and tokenizers.
KEEP_MODEL_BYTES = 4 << 30
KEEP_TOKENIZER_FILES = 16
MISS_LOCK_TIMEOUT_S = 600.0  # how long an engine waits for another's parse of the same model
FORMAT = 1  # of the cache files themselves
_EDGE = 2**20  # bytes hashed at each end of a weight file
_ROOT = Path(__file__).resolve().parent
_LOADER_SOURCES = ("model", "tokenizer.py", "model_files.py", "load_cache.py")
_loader_version: str | None = None


def default_cache_dir() -> str:
    """$BATON_LOAD_CACHE_DIR, else ~/.cache/baton/load."""
    return os.environ.get(LOAD_CACHE_ENV) or str(Path.home() / ".cache" / "baton" / "load")


def loader_version() -> str:
    """blake2b of the loader code's source (computed once per process)."""
    global _loader_version
    if _loader_version is None:
        h = hashlib.blake2b(digest_size=16)
        for name in _LOADER_SOURCES:
            target = _ROOT / name
            files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
            for f in files:
                h.update(str(f.relative_to(_ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
        _loader_version = h.hexdigest()
    return _loader_version


def _file_identity(f: Path) -> list:
    st = f.stat()
    h = hashlib.blake2b(digest_size=16)
    with open(f, "rb") as fh:
        h.update(fh.read(_EDGE))
        if st.st_size > _EDGE:
            fh.seek(max(_EDGE, st.st_size - _EDGE))
            h.update(fh.read(_EDGE))
    return [f.name, st.st_size, st.st_mtime_ns, h.hexdigest()]


def weights_identity(path: str | os.PathLike | None) -> list:
    """What keys a model's files (see the module docstring); the default model for None."""
    p = Path(path) if path is not None else Path(default_model_path())
    files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")) \
        if p.is_dir() else [p]
    return [_file_identity(f) for f in files]


def make_key(path: str | os.PathLike | None, **fields) -> dict:
    """A cache key: the weights' identity, the loader's version and `fields` (dtype, ...)."""
    return {"format": FORMAT, "loader": loader_version(), "weights": weights_identity(path),
            **fields}


def key_digest(key: dict) -> str:
    return hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()


def checksum(data) -> str:
    """The metadata's checksum (blake2b of the bytes, any buffer)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def bulk_checksum(data) -> str:
    """The weights' checksum, per tensor: CRC-32 of the bytes, which finds a flipped or torn
    byte as surely as any hash here (the cache is no defence against someone who may write
    the cache directory) at 4.5 times blake2b's speed: over the default model's 634 MB at
    load 8 on this 2-core host, crc32 0.52 s, sha256 1.04 s, blake2b 2.31 s."""
    return f"{zlib.crc32(data):08x}"


def atomic_write(final: Path, write: Callable[[object], None]) -> None:
    """`write(binary file)` into a temporary file beside `final`, fsync, rename over `final`."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def touch(file: Path) -> None:
    """Mark a cache file as used now (eviction keeps the most recently used)."""
    try:
        os.utime(file)
    except OSError:
        pass


def evict(cache_dir: str | os.PathLike, pattern: str, keep: int = 0,
          keep_bytes: int = 0) -> None:
    """Delete the files matching `pattern` past the `keep` most recently used (`keep` > 0), or
    past those that fit in `keep_bytes` together (the newest always stays). A reader that has
    one mapped keeps its pages: unlinking leaves the inode until it is unmapped."""
    files = []
    for f in Path(cache_dir).glob(pattern):
        try:
            st = f.stat()
        except OSError:
            continue  # deleted by another engine meanwhile
        files.append((st.st_mtime, st.st_size, f))
    total = 0
    for i, (_, size, f) in enumerate(sorted(files, key=lambda e: e[0], reverse=True)):
        total += size
        if (keep and i < keep) or (not keep and (i == 0 or total <= keep_bytes)):
            continue
        f.unlink(missing_ok=True)
        Path(f"{f}.lock").unlink(missing_ok=True)  # miss_lock's, if it had one
        logger.info("load cache: evicted %s", f)


@contextlib.contextmanager
def miss_lock(file: Path, timeout_s: float = MISS_LOCK_TIMEOUT_S):
    """Hold `file`.lock exclusively while this process builds `file`, so engines that miss at
    once parse the model once: the others wait here and then find the file. Past `timeout_s`
    (a builder stuck), or where the lock cannot be taken at all, the caller goes on unlocked:
    two writers are safe (temporary file, then rename), only slower."""
    try:
        import fcntl

        fd = os.open(f"{file}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    except (ImportError, OSError) as e:
        logger.warning("load cache: no lock for %s (%s): building it unlocked", file, e)
        yield
        return
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    logger.warning("load cache: %s still locked after %.0f s: building it "
                                   "unlocked", file, timeout_s)
                    break
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # releases the lock


# ---------------------------------------------------------------- tokenizer


def tokenizer_state(tokenizer) -> dict:
    """A `baton.tokenizer.Tokenizer` as JSON-able values (its HF tokenizer serialized)."""
    return {"backend": tokenizer.backend.to_str(), "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id, "chat_template": tokenizer.chat_template,
            "add_bos_token": tokenizer.add_bos_token}


def tokenizer_from_state(state: dict):
    from tokenizers import Tokenizer as HFTokenizer

    from baton.tokenizer import Tokenizer

    return Tokenizer(HFTokenizer.from_str(state["backend"]), bos_token_id=state["bos_token_id"],
                     eos_token_id=state["eos_token_id"], chat_template=state["chat_template"],
                     add_bos_token=state["add_bos_token"])


def _tokenizer_file(cache_dir: str | os.PathLike, key: dict) -> Path:
    return Path(cache_dir) / f"tokenizer-{key_digest(key)}.json"


def save_tokenizer(cache_dir: str | os.PathLike, path: str | os.PathLike | None, tokenizer,
                   context_length: int) -> None:
    """Write the tokenizer of the model at `path` and its context length; a failure to write
    is a warning (the cache is an optimisation)."""
    try:
        key = make_key(path, kind="tokenizer")
        payload = json.dumps({"tokenizer": tokenizer_state(tokenizer),
                              "context_length": context_length}, sort_keys=True)
        doc = json.dumps({"key": key, "sum": checksum(payload.encode()), "payload": payload})
        atomic_write(_tokenizer_file(cache_dir, key), lambda f: f.write(doc.encode()))
        evict(cache_dir, "tokenizer-*.json", keep=KEEP_TOKENIZER_FILES)
    except OSError as e:
        logger.warning("load cache: cannot write the tokenizer cache in %s: %s", cache_dir, e)


def load_tokenizer(cache_dir: str | os.PathLike, path: str | os.PathLike | None):
    """(tokenizer, context length) from the cache, or None: a miss (no file, another key, a
    bad checksum: the last two with a warning)."""
    key = make_key(path, kind="tokenizer")
    f = _tokenizer_file(cache_dir, key)
    try:
        doc = json.loads(f.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("load cache: %s unreadable (%s): rebuilding it", f, e)
        return None
    if not isinstance(doc, dict) or doc.get("key") != key or \
            checksum(str(doc.get("payload", "")).encode()) != doc.get("sum"):
        logger.warning("load cache: %s has another key or a bad checksum: rebuilding it", f)
        return None
    touch(f)
    try:
        payload = json.loads(doc["payload"])
        return tokenizer_from_state(payload["tokenizer"]), int(payload["context_length"])
    except Exception as e:  # a missing field, a bad value, tokenizers' own error type
        logger.warning("load cache: %s does not restore (%s): rebuilding it", f, e)
        return None
