"""Hash collisions never make the cache serve K/V computed for other tokens.

The prefix index identifies pages by chained, keyed hashes but never trusts a
hash: a candidate is accepted only if its stored tokens equal the prompt's
and its recorded parent is the page accepted one step earlier. These tests
replace the hash with degenerate ones through the constructor's test hook
(``PagedKVCache(..., _hash_fn=...)``), so that collisions happen on almost
every lookup, and check that

* no lookup ever returns a page whose prefix differs from the prompt's
  (a "wrong hit"), and every gathered row equals what the sequence itself
  wrote or what a sequence with the same prefix wrote;
* the cache keeps working, sharing only exact matches.

The K/V written for a token is a function of the whole prefix up to and
including it (as in a real model, where attention mixes in every earlier
token), so a page reused under a different prefix shows up in the data, not
only in the bookkeeping.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter

import numpy as np
import pytest

import pagedkv_np as pk
from pagedkv_np.prefix import blake2b_page_hash

from helpers import common_prefix, kv_rows

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 2, 2
_MASK = (1 << 64) - 1


# ---------------------------------------------------------- degenerate hashes
def constant_hash(secret: bytes, parent: bytes, tokens: bytes) -> bytes:
    return b"x"


def two_bit_hash(secret: bytes, parent: bytes, tokens: bytes) -> bytes:
    """Keyed and chained like the real one, but only 4 distinct values."""
    return bytes([hashlib.blake2b(parent + tokens, key=secret).digest()[0] & 3])


def seed_polynomial_hash(secret: bytes, parent: bytes, tokens: bytes) -> bytes:
    """The seed design's hash: h = h * 31 + t over one page, no key, no chain."""
    h = 0
    for t in np.frombuffer(tokens, dtype="<i8"):
        h = (h * 31 + int(t)) & _MASK
    return h.to_bytes(8, "little")


HASHES = {"constant": constant_hash, "two-bit": two_bit_hash,
          "seed-polynomial": seed_polynomial_hash}


# ------------------------------------------------------------------ driver
class Driver:
    """Runs prompts through a cache and audits every hit and every gather.

    A request may be served at most as many tokens as it shares with some
    earlier written prompt (whole pages or, with token-granular reuse, part
    of one); every whole page it is served must have been written for its
    own prefix; and every row it gathers must equal its own prefix's K/V.
    """

    def __init__(self, cache: pk.PagedKVCache) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.writer: dict[int, tuple] = {}   # page id -> prefix through its last written slot
        self.written: list[list[int]] = []   # prompts whose K/V was written
        self.counts = Counter()

    def run(self, prompt: list[int], keep: bool = False) -> pk.Sequence | None:
        cache, ps = self.cache, self.page_size
        rejected = cache.index.num_rejected
        seq = cache.add_sequence(prompt)
        num_hit = seq.num_cached_tokens // ps
        self.counts["lookups"] += 1
        self.counts["collisions_injected"] += cache.index.num_rejected - rejected
        self.counts["hit_pages"] += num_hit
        self.counts["hit_tokens"] += seq.num_cached_tokens
        shared = max((common_prefix(prompt, p) for p in self.written), default=0)
        if seq.num_cached_tokens > shared:
            self.counts["wrong_hits"] += 1
        for i, page_id in enumerate(seq.page_ids[:num_hit]):
            if self.writer.get(page_id) != tuple(prompt[:(i + 1) * ps]):
                self.counts["wrong_hits"] += 1
        try:
            cache.extend(seq, prompt[seq.num_cached_tokens:])
        except pk.OutOfPages:
            cache.release(seq)
            self.counts["out_of_pages"] += 1
            return None
        plan = cache.plan([seq])
        lo, hi = seq.num_cached_tokens, len(prompt)
        for layer in range(cache.num_layers):
            cache.write(layer, plan, *kv_rows(prompt, lo, hi, layer, NUM_KV_HEADS, HEAD_DIM))
        for j in range(lo // ps, -(-hi // ps)):
            self.writer[seq.page_ids[j]] = tuple(prompt[:min(hi, (j + 1) * ps)])
        self.written.append(prompt)
        for layer in range(cache.num_layers):
            k, v = map(cache.backend.to_numpy, cache.gather(layer, plan, layout="BTHD"))
            want_k, want_v = kv_rows(prompt, 0, hi, layer, NUM_KV_HEADS, HEAD_DIM)
            if not (np.array_equal(k[0].view(np.uint32), want_k.view(np.uint32))
                    and np.array_equal(v[0].view(np.uint32), want_v.view(np.uint32))):
                self.counts["wrong_data"] += 1
        if keep:
            return seq
        cache.release(seq)
        return None


def random_prompts(rng: random.Random, page_size: int, num: int) -> list[list[int]]:
    """Prompts glued from a few page-sized blocks over a tiny vocabulary, so
    that equal pages after different prefixes, and equal prefixes, are common."""
    blocks = [[rng.randrange(6) for _ in range(page_size)] for _ in range(5)]
    prompts = []
    for _ in range(num):
        body = [t for _ in range(rng.randint(1, 6)) for t in rng.choice(blocks)]
        prompts.append(body + [rng.randrange(6) for _ in range(rng.randint(0, 2))])
    return prompts


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("hash_name, page_size", [
    ("constant", 1), ("constant", 2), ("constant", 3), ("two-bit", 3), ("seed-polynomial", 3)])
def test_degenerate_hash_never_serves_other_tokens(hash_name: str, page_size: int, cache_backend):
    cache = pk.PagedKVCache(NUM_LAYERS, 48, page_size, NUM_KV_HEADS, HEAD_DIM,
                            backend=cache_backend, _hash_fn=HASHES[hash_name])
    driver = Driver(cache)
    rng = random.Random(1234 + page_size)
    for prompt in random_prompts(rng, page_size, 500):
        driver.run(prompt, keep=rng.random() < 0.1)
        if rng.random() < 0.1:  # drop some kept sequences so pages cycle
            for seq in list(cache._live.values())[:2]:
                cache.release(seq)
    cache.check_invariants()
    c = driver.counts
    print(f"\n{hash_name} hash, page_size {page_size}: {c['lookups']} lookups, "
          f"{c['collisions_injected']} collisions injected, {c['hit_pages']} pages and "
          f"{c['hit_tokens']} tokens hit, "
          f"{c['wrong_hits']} wrong hits, {c['wrong_data']} wrong gathers")
    assert c["collisions_injected"] > 100          # the hash really collides
    assert c["hit_tokens"] > 0                     # exact matches are still shared
    assert c["wrong_hits"] == 0
    assert c["wrong_data"] == 0


def test_constant_hash_cache_still_shares_exact_prefixes(cache_backend):
    cache = pk.PagedKVCache(NUM_LAYERS, 16, 2, NUM_KV_HEADS, HEAD_DIM, backend=cache_backend,
                            _hash_fn=constant_hash)
    driver = Driver(cache)
    driver.run([1, 2, 3, 4, 5])
    seq = driver.run([1, 2, 3, 4, 6], keep=True)     # first page is indexed: a hit
    assert seq.num_cached_tokens == 2
    other = driver.run([1, 9, 3, 4, 5], keep=True)   # same hash, other tokens: no page hit
    assert other.num_cached_tokens <= 1              # at most the common token, copied
    assert driver.counts["wrong_hits"] == 0 and driver.counts["wrong_data"] == 0
    assert cache.index.num_rejected >= 1


@pytest.mark.parametrize("hash_name", ["first-token", "chained-first-token"])
def test_page_after_a_colliding_parent_is_not_served(hash_name: str, cache_backend):
    """A page registered while its parent's hash was held by another page.

    ``B = [1, 7 | 5, 6 | 9]``: its first page collides with ``A``'s
    ``[1, 2]``, so it is not indexed; its second page ``[5, 6]`` must then
    not be indexed as a child of ``A``'s page, or the prompt
    ``[1, 2 | 5, 6 | 9]`` is served ``[5, 6]`` as computed after ``[1, 7]``.
    """
    # [1, 2] and [1, 7] collide when the hash only sees a page's first token;
    # the chained variant also sees one byte of the parent's hash.
    if hash_name == "first-token":
        hash_fn = lambda secret, parent, tokens: tokens[:8]  # noqa: E731
    else:
        hash_fn = lambda secret, parent, tokens: parent[:1] + tokens[:8]  # noqa: E731
    cache = pk.PagedKVCache(NUM_LAYERS, 16, 2, NUM_KV_HEADS, HEAD_DIM, backend=cache_backend,
                            _hash_fn=hash_fn)
    driver = Driver(cache)
    driver.run([1, 2, 3, 4, 9])
    driver.run([1, 7, 5, 6, 9])
    seq = driver.run([1, 2, 5, 6, 9], keep=True)
    assert driver.counts["wrong_hits"] == 0, (
        f"{seq.num_cached_tokens} tokens served; page [5, 6] was computed after [1, 7]")
    assert driver.counts["wrong_data"] == 0
    assert seq.num_cached_tokens == 2


def test_seed_polynomial_example_does_not_collide(cache_backend):
    """``[1, 0]`` and ``[0, 31]`` share the seed's hash (1*31+0 == 0*31+31)."""
    a, b = np.array([1, 0], "<i8").tobytes(), np.array([0, 31], "<i8").tobytes()
    assert seed_polynomial_hash(b"", b"", a) == seed_polynomial_hash(b"", b"", b)

    cache = pk.PagedKVCache(NUM_LAYERS, 16, 2, NUM_KV_HEADS, HEAD_DIM, backend=cache_backend)
    root, _ = cache.index.root()
    assert cache.index.page_digest(root, a) != cache.index.page_digest(root, b)
    driver = Driver(cache)
    driver.run([1, 0, 5])
    assert driver.run([0, 31, 5], keep=True).num_cached_tokens == 0
    assert driver.run([1, 0, 7], keep=True).num_cached_tokens == 2   # exact match: shared
    assert cache.index.num_rejected == 0       # the real hash did not even collide
    assert driver.counts["wrong_data"] == 0

    # With the seed's hash plugged in, the collision happens and is refused.
    weak = pk.PagedKVCache(NUM_LAYERS, 16, 2, NUM_KV_HEADS, HEAD_DIM, backend=cache_backend,
                           _hash_fn=seed_polynomial_hash)
    driver = Driver(weak)
    driver.run([1, 0, 5])
    assert driver.run([0, 31, 5], keep=True).num_cached_tokens == 0
    assert weak.index.num_rejected >= 1       # the lookup (and the indexing) refused it
    assert driver.counts["wrong_data"] == 0


def test_default_hash_is_keyed_and_chained(cache_backend):
    page = np.array([3, 1, 4, 1], "<i8").tobytes()
    root = b"\0" * 16
    assert blake2b_page_hash(b"k1", root, page) != blake2b_page_hash(b"k2", root, page)
    assert blake2b_page_hash(b"k1", root, page) == blake2b_page_hash(b"k1", root, page)
    assert blake2b_page_hash(b"k1", b"\1" * 16, page) != blake2b_page_hash(b"k1", root, page)
    # Caches given the same secret agree on hashes; caches without one do not.
    c1, c2 = (pk.PagedKVCache(1, 4, 4, 1, 1, backend=cache_backend, hash_secret=b"s")
              for _ in range(2))
    assert c1.index.root("t") == c2.index.root("t")
    r1, r2 = (pk.PagedKVCache(1, 4, 4, 1, 1, backend=cache_backend) for _ in range(2))
    assert r1.index.root("t")[0] != r2.index.root("t")[0]


def test_compat_record_page_after_a_colliding_parent_is_not_served(cache_backend):
    """The seed-compatible API: same scenario as above through record_page /
    lookup_prefix (the index's hash replaced the same way)."""
    pc = pk.PagedCache(1, 16, 2, 1, 1, backend=cache_backend)
    pc._index._hash = lambda secret, parent, tokens: tokens[:8]
    a, b = [1, 2, 3, 4, 9], [1, 7, 5, 6, 9]
    pages_a, pages_b = pc.alloc_n(2), pc.alloc_n(2)
    for i in range(2):
        pc.record_page(pages_a[i], a, i)
    for i in range(2):
        pc.record_page(pages_b[i], b, i)
    hits = pc.lookup_prefix([1, 2, 5, 6, 9])
    assert hits == pages_a[:1], f"served {hits}: page {pages_b[1]} holds [5, 6] after [1, 7]"
