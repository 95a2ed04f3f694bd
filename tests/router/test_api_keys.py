"""Named API keys (router/api_keys.py): each key its own rate limit (429 with Retry-After), its
own usage counters, an unknown key a 401, and --cache-salt-per-key keeps keys' caches apart.
The router runs with no engine behind it: an admitted request gets its 503 at once."""

from __future__ import annotations

import pytest

from router.api_keys import ApiKey, ApiKeys, load_api_keys, per_key_salt
from router.config import RouterConfig

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}
ALICE, BOB = "sk-alice-0123456789abcdef", "sk-bob-0123456789abcdef0"


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n"
                    f"  - {{name: alice, key: {ALICE}, requests_per_minute: 2}}\n"
                    f"  - {{name: bob, key: {BOB}}}\n")
    path.chmod(0o600)
    return str(path)


def _post(client, key: str):
    return client.post("/v1/chat/completions", json=BODY,
                       headers={"Authorization": f"Bearer {key}"})


def test_each_key_has_its_own_limit_and_counters(make_client, keys_file):
    client = make_client(api_keys_file=keys_file, api_key="legacy-key")
    assert [_post(client, ALICE).status_code for _ in range(2)] == [503, 503]
    limited = _post(client, ALICE)
    assert limited.status_code == 429 and int(limited.headers["Retry-After"]) >= 1
    error = limited.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "'alice'" in error["message"]
    # Bob (no limit) and the single --api-key (named default) are not held back by Alice.
    assert [_post(client, BOB).status_code for _ in range(4)] == [503] * 4
    assert _post(client, "legacy-key").status_code == 503
    assert _post(client, "sk-nobody-0123456789").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {ALICE}"}).status_code \
        == 200  # the limit is on generation requests only
    metrics = client.get("/metrics").text
    for key, status, count in (("alice", "503", 2), ("alice", "429", 1), ("bob", "503", 4),
                               ("default", "503", 1)):
        assert f'baton_router_api_key_requests_total{{key="{key}",status="{status}"}} ' \
               f'{float(count)}' in metrics, metrics


def test_the_bucket_refills_and_waits_are_whole_seconds(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("router.api_keys.time.monotonic", lambda: clock[0])
    keys = ApiKeys([ApiKey("a", "k", requests_per_minute=6)])
    assert [keys.take("a") for _ in range(6)] == [0] * 6
    assert keys.take("a") == 10  # one request per 10 s
    clock[0] += 10
    assert keys.take("a") == 0 and keys.take("a") == 10
    assert keys.identify(b"Bearer k").name == "a" and keys.identify(b"Bearer x") is None


def test_keys_file_rules(tmp_path):
    path = tmp_path / "k.yaml"

    def refused(text: str, words: str, mode: int = 0o600) -> None:
        path.write_text(text)
        path.chmod(mode)
        with pytest.raises(ValueError, match=words):
            load_api_keys(str(path))

    ok = f"keys:\n  - {{name: a, key: {ALICE}}}\n"
    refused(ok, "readable by every user", 0o644)
    refused("keys: []\n", "non-empty list")
    refused(f"keys:\n  - {{name: a, key: {ALICE}, rpm: 3}}\n", "nothing else")
    refused("keys:\n  - {name: a, key: short}\n", "shorter than 16")
    refused(f"keys:\n  - {{name: a, key: {ALICE}}}\n  - {{name: a, key: {BOB}}}\n", "share a name")
    refused(f"keys:\n  - {{name: 'a b', key: {ALICE}}}\n", "letters, digits")
    refused(f"keys:\n  - {{name: a, key: {ALICE}, requests_per_minute: -1}}\n", ">= 0")
    path.write_text(ok)
    path.chmod(0o600)
    assert [k.name for k in load_api_keys(str(path))] == ["a"]
    with pytest.raises(ValueError, match="needs API keys"):
        RouterConfig(cache_salt_per_key=True)


def test_cache_salt_per_key_namespaces_every_salt():
    assert per_key_salt("alice", "") != per_key_salt("bob", "")
    assert per_key_salt("alice", "x") != per_key_salt("alice", "")
    # No key can choose a salt that lands in another key's namespace.
    assert per_key_salt("alice", "bob") != per_key_salt("bob", "alice")
    assert len(per_key_salt("a" * 100, "s" * 256)) == 64  # within the wire's bound
