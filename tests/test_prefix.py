"""The prefix index: chained keyed hashes, verified lookups, salts."""

import numpy as np
import pytest

from pagedkv_np import PagedKVCache
from pagedkv_np.errors import ConfigError, DTypeError
from pagedkv_np.prefix import PrefixIndex, blake2b_page_hash, encode_salt

PS = 4
SECRET = b"0123456789abcdef"


def tok(*ids):
    return np.asarray(ids, dtype="<i8").tobytes()


def index_prompt(index, page_ids, tokens, salt=None):
    """Register each full page of ``tokens`` in ``page_ids``, chained as the
    cache does; return the digests."""
    raw = tok(*tokens)
    step = 8 * index.page_size
    digest, parent = index.root(salt)
    digests = []
    for i, page_id in enumerate(page_ids):
        chunk = raw[i * step:(i + 1) * step]
        digest = index.page_digest(digest, chunk)
        index.register(page_id, digest, chunk, parent)
        parent = index.identity(index.canonical(digest))
        digests.append(digest)
    return digests


def lookup(index, tokens, salt=None, max_pages=None, count=True):
    if max_pages is None:
        max_pages = len(tokens) // index.page_size
    return index.lookup(tok(*tokens), len(tokens), max_pages, salt, count)[0]


A = [1, 2, 3, 4]
B = [5, 6, 7, 8]
C = [9, 9, 9, 9]


def test_blake2b_page_hash_is_keyed_and_16_bytes():
    h = blake2b_page_hash(SECRET, b"parent", tok(*A))
    assert len(h) == 16
    assert h == blake2b_page_hash(SECRET, b"parent", tok(*A))
    assert h != blake2b_page_hash(b"another secret!!", b"parent", tok(*A))
    assert h != blake2b_page_hash(SECRET, b"parenu", tok(*A))
    assert h != blake2b_page_hash(SECRET, b"parent", tok(*B))


def test_hash_of_a_page_depends_on_its_prefix():
    index = PrefixIndex(PS, SECRET)
    after_a = index_prompt(index, [0, 1], A + C)
    after_b = index_prompt(index, [2, 3], B + C)
    assert after_a[1] != after_b[1]  # same page tokens C, different prefixes


def test_same_tokens_at_different_positions_hash_differently():
    index = PrefixIndex(PS, SECRET)
    digests = index_prompt(index, [0, 1, 2], C + C + C)
    assert len(set(digests)) == 3
    assert len(index) == 3


def test_lookup_returns_the_longest_indexed_prefix():
    index = PrefixIndex(PS, SECRET)
    index_prompt(index, [7, 3], A + B)
    assert lookup(index, A + B + C) == [7, 3]
    assert lookup(index, A + B) == [7, 3]
    assert lookup(index, A + C) == [7]
    assert lookup(index, B + A) == []
    assert lookup(index, A[:3]) == []
    assert lookup(index, A + B, max_pages=1) == [7]
    pages, digests = index.lookup(tok(*A, *B), 8, 2)
    assert digests == index_prompt(PrefixIndex(PS, SECRET), [0, 1], A + B)


def test_a_page_after_another_prefix_is_not_served():
    index = PrefixIndex(PS, SECRET)
    index_prompt(index, [0, 1], A + C)
    assert lookup(index, B + C) == []
    index_prompt(index, [2], B)
    assert lookup(index, B + C) == [2]


def test_same_secret_agrees_and_different_secrets_differ():
    one, two = PrefixIndex(PS, SECRET), PrefixIndex(PS, bytearray(SECRET))
    other = PrefixIndex(PS, b"another secret")
    assert one.secret == two.secret == SECRET
    assert index_prompt(one, [0, 1], A + B) == index_prompt(two, [5, 6], A + B)
    assert index_prompt(one, [2, 3], B + C) != index_prompt(other, [2, 3], B + C)
    assert one.root("x")[0] == two.root("x")[0] != other.root("x")[0]


def test_default_secret_is_random():
    one, two = PrefixIndex(PS), PrefixIndex(PS)
    assert len(one.secret) == 32 and one.secret != two.secret
    assert one.root()[0] != two.root()[0]


@pytest.mark.parametrize("bad", [b"", b"x" * 65, "a string", 12345])
def test_secret_is_validated(bad):
    with pytest.raises(ConfigError, match="secret"):
        PrefixIndex(PS, bad)


@pytest.mark.parametrize("bad, error", [(0, ConfigError), (2.0, DTypeError)])
def test_page_size_is_validated(bad, error):
    with pytest.raises(error, match="page_size"):
        PrefixIndex(bad, SECRET)


def test_salt_isolates_prompts():
    index = PrefixIndex(PS, SECRET)
    index_prompt(index, [0, 1], A + B, salt="tenant-a")
    assert lookup(index, A + B, salt="tenant-a") == [0, 1]
    assert lookup(index, A + B, salt="tenant-b") == []
    assert lookup(index, A + B) == []
    index_prompt(index, [2, 3], A + B, salt="tenant-b")
    assert lookup(index, A + B, salt="tenant-b") == [2, 3]
    assert lookup(index, A + B, salt="tenant-a") == [0, 1]


def test_salts_of_different_types_never_collide():
    salts = [None, "", b"", 0, "0", b"0", 1, "1", b"1", "i1", b"s"]
    encoded = [encode_salt(s) for s in salts]
    assert len(set(encoded)) == len(salts)
    index = PrefixIndex(PS, SECRET)
    roots = {index.root(s)[0] for s in salts}
    assert len(roots) == len(salts)


def test_a_numpy_int_salt_is_the_same_salt_as_the_python_int():
    index = PrefixIndex(PS, SECRET)
    for numpy_int in (np.int64(7), np.uint8(7), np.int32(7)):
        assert encode_salt(numpy_int) == encode_salt(7)
        assert index.root(numpy_int) == index.root(7)
    assert encode_salt(np.int64(7)) != encode_salt(8)


@pytest.mark.parametrize("bad", [1.5, True, np.bool_(True), ["a"], object()])
def test_bad_salt_raises(bad):
    with pytest.raises(DTypeError, match="salt"):
        encode_salt(bad)


def test_register_rejects_a_partial_page():
    index = PrefixIndex(PS, SECRET)
    digest, parent = index.root()
    with pytest.raises(ConfigError, match="tokens"):
        index.register(0, b"x" * 16, tok(1, 2, 3), parent)
    assert len(index) == 0


def test_first_copy_stays_canonical():
    index = PrefixIndex(PS, SECRET)
    digest, parent = index.root()
    d = index.page_digest(digest, tok(*A))
    assert index.register(4, d, tok(*A), parent)
    assert index.register(4, d, tok(*A), parent)  # the same page again: still indexed
    assert not index.register(5, d, tok(*A), parent)
    assert index.canonical(d) == 4 and 5 not in index and len(index) == 1


def test_insert_indexes_new_content_and_reports_identities():
    index = PrefixIndex(PS, SECRET)
    root_digest, root = index.root()
    digest, identity, indexed = index.insert(3, root_digest, root, tok(*A))
    assert indexed and identity == index.identity(3) and index.canonical(digest) == 3
    assert digest == index.page_digest(root_digest, tok(*A))
    # the same page again
    assert index.insert(3, root_digest, root, tok(*A)) == (digest, identity, True)
    # the same content in another page: children record the indexed page
    assert index.insert(4, root_digest, root, tok(*A)) == (digest, identity, False)
    assert 4 not in index
    # a child of it
    d2, id2, indexed = index.insert(5, digest, identity, tok(*B))
    assert indexed and lookup(index, A + B) == [3, 5]
    assert index.num_rejected == 0


def test_insert_of_colliding_content_indexes_nothing_below_it():
    index = PrefixIndex(PS, SECRET, hash_fn=lambda secret, parent, tokens: b"same")
    root_digest, root = index.root()
    digest, identity, _ = index.insert(0, root_digest, root, tok(*A))
    assert index.insert(1, root_digest, root, tok(*B)) == (b"same", None, False)
    assert index.num_rejected == 1 and len(index) == 1
    # same tokens after another parent collide too
    assert index.insert(2, digest, identity, tok(*A))[1] is None


def test_register_moves_a_page_to_a_new_prefix():
    index = PrefixIndex(PS, SECRET)
    index_prompt(index, [0], A)
    gen = index.identity(0)
    index_prompt(index, [0], B)
    assert lookup(index, A + C) == [] and lookup(index, B + C) == [0]
    assert index.identity(0) != gen
    assert len(index) == 1
    index.check_invariants()


def test_remove_forgets_a_page_and_bumps_its_generation():
    index = PrefixIndex(PS, SECRET)
    index_prompt(index, [0, 1], A + B)
    before = index.identity(1)
    index.remove(1)
    assert 1 not in index and index.entry_tokens(1) is None
    assert index.identity(1) == ("page", 1, before[2] + 1)
    assert lookup(index, A + B) == [0]
    index.remove(1)  # not indexed: no-op, generation unchanged
    assert index.identity(1) == ("page", 1, before[2] + 1)
    index.check_invariants()


def test_generation_bump_prevents_serving_an_orphaned_child():
    index = PrefixIndex(PS, SECRET)
    index_prompt(index, [5, 6], A + B)
    assert lookup(index, A + B) == [5, 6]
    index.remove(5)  # parent evicted ...
    index_prompt(index, [5], A)  # ... and its page reused for the same prefix
    # page 6 was computed after the old contents of page 5; it must not be served
    assert lookup(index, A + B) == [5]
    assert index.num_rejected == 1


def test_lookup_counts_query_and_hit_tokens():
    index = PrefixIndex(PS, SECRET)
    index_prompt(index, [0, 1], A + B)
    lookup(index, A + B + [1, 2])
    assert (index.query_tokens, index.hit_tokens) == (10, 8)
    lookup(index, B + A)
    assert (index.query_tokens, index.hit_tokens) == (18, 8)
    lookup(index, A + B, count=False)
    assert (index.query_tokens, index.hit_tokens) == (18, 8)


def test_degenerate_hash_only_returns_exact_matches():
    calls = []

    def same(secret, parent, tokens):
        calls.append(tokens)
        return b"all alike"

    index = PrefixIndex(PS, SECRET, hash_fn=same)
    index_prompt(index, [0, 1], A + B)
    assert calls, "the given hash function is used"
    assert len(index) == 1  # every page has the same hash: only the first is indexed
    assert lookup(index, A + B) == [0]
    assert index.num_rejected == 1  # page 1 of the prompt hit page 0's entry
    assert lookup(index, B + A) == []
    assert index.num_rejected == 2
    assert lookup(index, A) == [0]
    index.check_invariants()


def test_check_invariants_detects_disagreeing_maps():
    index = PrefixIndex(PS, SECRET)
    index_prompt(index, [0, 1], A + B)
    index.check_invariants()
    index._by_hash[b"stray"] = 3
    with pytest.raises(AssertionError):
        index.check_invariants()
    del index._by_hash[b"stray"]
    digest = index._entries[0].digest
    index._by_hash[digest] = 1
    with pytest.raises(AssertionError):
        index.check_invariants()


# ------------------------------------------------------- through the cache

def run_request(cache, prompt, salt=None, expected_kv=None):
    seq = cache.add_sequence(prompt, salt)
    cache.extend(seq, prompt[seq.num_cached_tokens:])
    plan = cache.plan([seq])
    start = int(plan.context_lens[0])
    for layer in range(cache.num_layers):
        k, v = expected_kv(prompt, salt, layer, cache.num_kv_heads, cache.head_dim, cache.dtype)
        cache.write(layer, plan, k[start:], v[start:])
    return seq, plan


def gathered_equal(cache, seq, expected_kv):
    plan = cache.plan([seq])
    tokens = seq.tokens
    for layer in range(cache.num_layers):
        k, v = cache.gather(layer, plan, layout="BTHD")
        ek, ev = expected_kv(tokens, seq.salt, layer, cache.num_kv_heads, cache.head_dim,
                             cache.dtype)
        if not (np.array_equal(k[0], ek) and np.array_equal(v[0], ev)):
            return False
    return True


def test_cache_with_a_degenerate_hash_still_works(expected_kv):
    cache = PagedKVCache(2, 32, 2, 1, 2, dtype="float32", backend="numpy",
                         _hash_fn=lambda secret, parent, tokens: b"\0" * 16)
    first = [1, 2, 3, 4, 5, 6, 7]
    seq, _ = run_request(cache, first, expected_kv=expected_kv)
    cache.release(seq)
    # Page 0 of the first prompt is the only page indexed (all hashes agree).
    again = cache.add_sequence(first)
    assert again.num_cached_tokens == 2
    cache.extend(again, first[2:])
    plan = cache.plan([again])
    for layer in range(2):
        k, v = expected_kv(first, None, layer, 1, 2, "float32")
        cache.write(layer, plan, k[2:], v[2:])
    assert gathered_equal(cache, again, expected_kv)
    cache.release(again)
    rejected = cache.index.num_rejected
    other = cache.add_sequence([9, 9, 3, 4, 5])
    assert other.num_cached_tokens == 0
    assert cache.index.num_rejected == rejected + 1
    cache.check_invariants()


@pytest.mark.parametrize("partial", [False, True])
def test_cache_caps_a_hit_at_len_minus_one(expected_kv, partial):
    cache = PagedKVCache(1, 16, 4, 1, 2, dtype="float32", backend="numpy",
                         partial_page_reuse=partial)
    prompt = list(range(1, 13))  # 3 full pages
    seq, _ = run_request(cache, prompt, expected_kv=expected_kv)
    cache.release(seq)
    for length, cached in [(12, 8), (13, 12), (9, 8), (8, 4), (5, 4), (4, 0), (1, 0)]:
        probe = (prompt + [99])[:length]
        s = cache.add_sequence(probe)
        # whole pages only, or every shared token but the last
        assert s.num_cached_tokens == (min(length - 1, 12) if partial else cached), length
        assert s.num_cached_tokens <= length - 1
        cache.release(s)
    cache.check_invariants()


def test_cache_counts_prefix_tokens(expected_kv):
    cache = PagedKVCache(1, 16, 2, 1, 2, dtype="float32", backend="numpy")
    seq, _ = run_request(cache, [1, 2, 3, 4, 5], expected_kv=expected_kv)
    cache.release(seq)
    assert (cache.stats.prefix_query_tokens, cache.stats.prefix_hit_tokens) == (5, 0)
    s = cache.add_sequence([1, 2, 3, 4, 7, 8])
    assert s.num_cached_tokens == 4
    assert (cache.stats.prefix_query_tokens, cache.stats.prefix_hit_tokens) == (11, 4)
    assert cache.stats.prefix_hit_rate == pytest.approx(4 / 11)


def test_cache_salt_isolation(expected_kv):
    cache = PagedKVCache(1, 16, 2, 1, 2, dtype="float32", backend="numpy")
    prompt = [1, 2, 3, 4, 5]
    seq, _ = run_request(cache, prompt, salt="a", expected_kv=expected_kv)
    cache.release(seq)
    assert cache.add_sequence(prompt, salt="b").num_cached_tokens == 0
    assert cache.add_sequence(prompt).num_cached_tokens == 0
    assert cache.add_sequence(prompt, salt="a").num_cached_tokens == 4


def test_caches_with_the_same_secret_agree_on_hashes(expected_kv):
    one = PagedKVCache(1, 8, 2, 1, 2, backend="numpy", hash_secret=SECRET)
    two = PagedKVCache(1, 8, 2, 1, 2, backend="numpy", hash_secret=SECRET)
    s1, _ = run_request(one, [1, 2, 3, 4, 5], expected_kv=expected_kv)
    s2, _ = run_request(two, [1, 2, 3, 4, 5], expected_kv=expected_kv)
    one.add_sequence([0])  # commits the pending pages
    two.add_sequence([0])
    assert s1._digests == s2._digests and len(s1._digests) == 2
