"""Named API keys: who a request is, how fast it may ask, and (optionally) its own cache.

A keys file (`--api-keys-file`, default $BATON_API_KEYS_FILE; YAML, 0600) names each key:

    keys:
      - {name: alice, key: sk-alice-..., requests_per_minute: 60}
      - {name: batch, key: sk-batch-...}          # no limit

A request must carry one of them (`Authorization: Bearer KEY`, else 401). Each named key has
its own token bucket of `requests_per_minute` generation requests (a burst of that many, refilled
evenly); past it the answer is 429 with `Retry-After` (whole seconds until the next token). Each
key's requests (by status) and tokens (prompt, generated) are counted in the router's metrics.
With `--cache-salt-per-key` a key's requests share a prefix cache only among themselves: the
key's name enters every request's cache salt (baton/engine/block_keys.py, P1).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import time

from baton.ops.registry import read_private_file

ENV_KEYS_FILE = "BATON_API_KEYS_FILE"
_MAX_FILE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class ApiKey:
    name: str  # shown in metrics and logs; the key itself never is
    key: str = dataclasses.field(repr=False)
    requests_per_minute: float = 0.0  # generation requests; 0 = no limit

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"API key name {self.name!r} must be letters, digits, - or _")
        if not self.key:
            raise ValueError(f"API key {self.name!r} is empty")
        if not (isinstance(self.requests_per_minute, int | float)
                and 0 <= self.requests_per_minute < math.inf):
            raise ValueError(f"API key {self.name!r}: requests_per_minute must be >= 0, got "
                             f"{self.requests_per_minute!r}")


def load_api_keys(path: str) -> list[ApiKey]:
    """The keys of a keys file; ValueError naming what is wrong with it."""
    import yaml

    raw = read_private_file(path, "API keys file", _MAX_FILE_BYTES)
    if len(raw) > _MAX_FILE_BYTES:
        raise ValueError(f"API keys file {path} exceeds {_MAX_FILE_BYTES} bytes")
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ValueError(f"API keys file {path} is not YAML: {exc}") from None
    entries = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"API keys file {path} needs a non-empty list under 'keys'")
    keys = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) - {"name", "key", "requests_per_minute"}:
            raise ValueError(f"API keys file {path}: entry {i} must have name, key and "
                             "optionally requests_per_minute, nothing else")
        key = ApiKey(str(entry.get("name", "")), str(entry.get("key", "")),
                     entry.get("requests_per_minute", 0))
        if len(key.key) < 16:
            raise ValueError(f"API keys file {path}: the key of {key.name!r} is shorter than "
                             "16 characters")
        keys.append(key)
    for attr in ("name", "key"):
        values = [getattr(k, attr) for k in keys]
        if len(set(values)) != len(values):
            raise ValueError(f"API keys file {path}: two entries share a {attr}")
    return keys


class ApiKeys:
    """The router's keys: who a header names, and each key's token bucket."""

    def __init__(self, keys: list[ApiKey]):
        self._by_header = [(f"Bearer {k.key}".encode(), k) for k in keys]
        self._buckets = {k.name: (float(k.requests_per_minute), time.monotonic())
                         for k in keys if k.requests_per_minute}
        self.names = [k.name for k in keys]
        self._limits = {k.name: float(k.requests_per_minute) for k in keys}

    def identify(self, authorization: bytes) -> ApiKey | None:
        found = None
        for expected, key in self._by_header:  # every key compared: no early exit to time
            if hmac.compare_digest(authorization, expected):
                found = key
        return found

    def take(self, name: str) -> int:
        """Take one request from `name`'s bucket: 0 when allowed, else the seconds to wait."""
        rpm = self._limits.get(name, 0.0)
        if not rpm:
            return 0
        tokens, at = self._buckets[name]
        now = time.monotonic()
        tokens = min(rpm, tokens + (now - at) * rpm / 60.0)
        if tokens >= 1.0:
            self._buckets[name] = (tokens - 1.0, now)
            return 0
        self._buckets[name] = (tokens, now)
        return max(1, math.ceil((1.0 - tokens) * 60.0 / rpm))


def per_key_salt(key_name: str, cache_salt: str) -> str:
    """The cache salt a request of `key_name` runs with (--cache-salt-per-key): its own salt
    within the key's namespace, so no key can pick a salt that lands in another's cache."""
    return hashlib.sha256(f"{key_name}\0{cache_salt}".encode()).hexdigest()
