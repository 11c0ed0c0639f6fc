"""Two ``pagedkv serve`` replicas sharing one Valkey server: a prompt that
replica A answered is a prefix hit on replica B (its pages come from Valkey),
B's greedy answer equals A's, and another tenant's salt shares nothing.

The Valkey binary is found as in ``tests/test_tier_redis.py``; both replicas
take the same hash secret from ``PAGEDKV_HASH_SECRET``.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("starlette", reason="the serve extra is not installed")
pytest.importorskip("redis", reason="the redis extra is not installed")

from test_serve import MODEL, Server, build_folder  # noqa: E402
from test_tier_redis import Server as Valkey  # noqa: E402

SYSTEM = ("You are a helpful assistant. Answer briefly and precisely. The capital of France "
          "is Paris, the capital of Japan is Tokyo. Hello world! How are you today? " * 8)


def ask(server: Server, salt: str | None = None) -> tuple[str, int, int]:
    """(answer, cached prompt tokens, prompt tokens) of one greedy chat request."""
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": "What is the capital of France?"}]}
    if salt is not None:
        body["cache_salt"] = salt
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    usage = out["usage"]
    return (out["choices"][0]["message"]["content"],
            usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"])


def test_two_replicas_share_prefix_pages_through_valkey(tmp_path, monkeypatch):
    folder = tmp_path / MODEL
    build_folder(folder)
    valkey = Valkey(tmp_path).start()
    monkeypatch.setenv("PAGEDKV_HASH_SECRET", "replicas-share-this-secret")
    args = (str(folder), "--redis-url", valkey.url, "--num-pages", "128", "--page-size", "16")
    replicas = []
    try:
        replicas = [Server(*args), Server(*args)]
        a, b = replicas
        answer_a, cached_a, prompt_tokens = ask(a)
        assert cached_a == 0 and prompt_tokens > 64
        # A's pages reach Valkey in the background
        client = valkey.client()
        deadline = time.monotonic() + 30
        while client.dbsize() < prompt_tokens // 16 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.dbsize() >= prompt_tokens // 16
        # another tenant on B: nothing shared
        _, cached_other, _ = ask(b, salt="another-tenant")
        assert cached_other == 0
        answer_b, cached_b, prompt_b = ask(b)
        assert prompt_b == prompt_tokens
        assert cached_b >= 16 * (prompt_tokens // 16 - 1), (cached_b, prompt_tokens)
        assert answer_b == answer_a
        print(f"replica B: {cached_b} of {prompt_tokens} prompt tokens from Valkey; "
              f"another tenant: {cached_other}")
    finally:
        for s in replicas:
            assert s.stop() == 0
        valkey.kill()
