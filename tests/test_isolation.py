"""Per-tenant salts: no page is ever shared across salts, and nothing else changes.

A salt enters the root of the hash chain and the recorded parent of every
first page, so sequences with different salts cannot hit each other's pages
(which would let one tenant time another's prompts). Random scripts of
requests (prompts glued from a few shared blocks, salts from a small set that
includes look-alikes such as ``"1"``, ``1`` and ``b"1"``) are replayed and
audited:

* every page a lookup returns was written by a sequence with the same salt
  and the same prefix;
* at every moment, live sequences with different salts hold disjoint pages;
* every gathered row is what the sequence itself would have written;
* renaming the salts one-to-one, or giving every request the same salt
  (whichever), yields exactly the same hits, page ids and data.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv_np as pk
from pagedkv_np.prefix import encode_salt

from helpers import common_prefix, kv_rows

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, NUM_PAGES = 2, 2, 2, 40
SALTS = [None, "a", "b", b"a", 1, "1", b"1", ""]


def replay(backend, script, page_size: int, salt_of=lambda s: s, hash_fn=None) -> list[tuple]:
    """Run ``script`` (a list of (prompt, salt, keep)) on a cache of
    ``backend`` and audit it; return what a caller can observe, request by
    request."""
    cache = pk.PagedKVCache(NUM_LAYERS, NUM_PAGES, page_size, NUM_KV_HEADS, HEAD_DIM,
                            backend=backend, hash_secret=b"isolation", _hash_fn=hash_fn)
    writer: dict[int, tuple] = {}       # page id -> (salt bytes, prefix through its last slot)
    written: dict[bytes, list] = {}     # salt bytes -> prompts written under it
    live: list[tuple[pk.Sequence, bytes]] = []
    trace = []
    for prompt, salt, keep in script:
        salt = salt_of(salt)
        salt_bytes = encode_salt(salt)
        seq = cache.add_sequence(prompt, salt=salt)
        num_hit = seq.num_cached_tokens // page_size
        # Reuse (whole pages, or part of one) only from this salt's own prompts.
        shared = max((common_prefix(prompt, p) for p in written.get(salt_bytes, [])), default=0)
        assert seq.num_cached_tokens <= shared, (
            f"salt {salt!r} was served {seq.num_cached_tokens} tokens but shares only "
            f"{shared} with its own earlier prompts")
        for i, page_id in enumerate(seq.page_ids[:num_hit]):
            assert writer[page_id] == (salt_bytes, tuple(prompt[:(i + 1) * page_size])), (
                f"page {page_id} served to salt {salt!r} was written under "
                f"salt {writer[page_id][0]!r} for {writer[page_id][1]}")
        try:
            cache.extend(seq, prompt[seq.num_cached_tokens:])
        except pk.OutOfPages:
            cache.release(seq)
            trace.append(("out of pages", num_hit))
            continue
        plan = cache.plan([seq])
        lo, hi = seq.num_cached_tokens, len(prompt)
        for layer in range(NUM_LAYERS):
            cache.write(layer, plan, *kv_rows(prompt, lo, hi, layer, NUM_KV_HEADS, HEAD_DIM))
        for j in range(lo // page_size, -(-hi // page_size)):
            writer[seq.page_ids[j]] = (salt_bytes, tuple(prompt[:min(hi, (j + 1) * page_size)]))
        written.setdefault(salt_bytes, []).append(prompt)
        digest = hashlib.sha256()
        for layer in range(NUM_LAYERS):
            k, v = map(cache.backend.to_numpy, cache.gather(layer, plan, layout="BTHD"))
            want_k, want_v = kv_rows(prompt, 0, hi, layer, NUM_KV_HEADS, HEAD_DIM)
            assert np.array_equal(k[0].view(np.uint32), want_k.view(np.uint32))
            assert np.array_equal(v[0].view(np.uint32), want_v.view(np.uint32))
            digest.update(k.tobytes() + v.tobytes())
        if keep:
            live.append((seq, salt_bytes))
        else:
            cache.release(seq)
        for s1, b1 in live:
            for s2, b2 in live:
                if b1 != b2:
                    shared = set(s1.page_ids) & set(s2.page_ids)
                    assert not shared, f"salts {b1!r} and {b2!r} share pages {shared}"
        trace.append((num_hit, seq.page_ids, digest.hexdigest()))
        cache.check_invariants()
    stats = cache.stats
    trace.append((stats.prefix_hit_tokens, stats.prefix_query_tokens, stats.pages_evictable))
    return trace


@st.composite
def scripts(draw, page_size: int):
    blocks = [[draw(st.integers(0, 4)) for _ in range(page_size)] for _ in range(4)]
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        body = [t for b in draw(st.lists(st.integers(0, 3), min_size=0, max_size=5))
                for t in blocks[b]]
        tail = draw(st.lists(st.integers(0, 4), min_size=0 if body else 1, max_size=2))
        requests.append((body + tail, draw(st.sampled_from(SALTS)), draw(st.booleans())))
    return requests


SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None)
COMPARE = settings(max_examples=15, deadline=None, derandomize=True, database=None)


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_no_page_is_shared_across_salts(page_size: int, cache_backend):
    @SETTINGS
    @given(scripts(page_size))
    def check(script):
        replay(cache_backend, script, page_size)

    check()


def test_no_page_is_shared_across_salts_even_when_every_hash_collides(cache_backend):
    @SETTINGS
    @given(scripts(2))
    def check(script):
        replay(cache_backend, script, 2, hash_fn=lambda secret, parent, tokens: b"x")

    check()


@pytest.mark.parametrize("page_size", [1, 3])
def test_renaming_salts_changes_nothing(page_size: int, cache_backend):
    rename = {None: "z", "a": b"b", "b": 2, b"a": None, 1: "1 ", "1": b"", b"1": "b", "": 1}
    assert len(set(map(repr, rename.values()))) == len(rename)

    @COMPARE
    @given(scripts(page_size))
    def check(script):
        assert (replay(cache_backend, script, page_size)
                == replay(cache_backend, script, page_size, salt_of=rename.get))

    check()


@pytest.mark.parametrize("salt", ["tenant", b"tenant", 7])
def test_one_salt_for_everyone_behaves_like_no_salt(salt, cache_backend):
    @COMPARE
    @given(scripts(2))
    def check(script):
        assert (replay(cache_backend, script, 2, salt_of=lambda s: salt)
                == replay(cache_backend, script, 2, salt_of=lambda s: None))

    check()


def test_same_salt_shares_and_other_salts_do_not(cache_backend):
    cache = pk.PagedKVCache(1, 16, 2, 1, 1, backend=cache_backend)
    prompt = [1, 2, 3, 4, 5]

    def served(salt) -> int:
        seq = cache.add_sequence(prompt, salt=salt)
        cache.extend(seq, prompt[seq.num_cached_tokens:])
        plan = cache.plan([seq])
        n = plan.num_new_tokens
        cache.write(0, plan, np.zeros((n, 1, 1), np.float32), np.zeros((n, 1, 1), np.float32))
        cache.release(seq)
        return seq.num_cached_tokens

    assert served("tenant-a") == 0
    assert served("tenant-a") == 4
    for other in ("tenant-b", b"tenant-a", None, "", 0):
        assert served(other) == 0, f"salt {other!r} was served tenant-a's pages"
    assert len({cache.index.root(s)[0] for s in ("tenant-a", b"tenant-a", None, "", 0)}) == 5


def test_a_weak_hash_does_not_leak_pages_across_salts(cache_backend):
    """Tenant b's page must not be reachable by tenant a even when page hashes
    collide: ``[5, 6]`` was written by b after ``[1, 2]``, and a asks for
    ``[1, 2, 5, 6, 9]`` after writing ``[1, 2, 3, 4, 9]`` itself."""
    tokens_only = lambda secret, parent, tokens: tokens  # noqa: E731
    script = [([1, 2, 3, 4, 9], "a", False), ([1, 2, 5, 6, 9], "b", False),
              ([1, 2, 5, 6, 9], "a", False)]
    replay(cache_backend, script, 2, hash_fn=tokens_only)
