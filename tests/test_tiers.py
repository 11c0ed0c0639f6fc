"""The tier interface: entry format, keys, verified loads into a PagedKVCache,
salts and models that never cross, the write queue, and typed errors for
every bad tier argument.

The K/V written into caches here is ``expected_kv`` (a function of salt,
layer and the whole prefix), so a page served after another prefix, salt
or model would show up as a data mismatch.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from pagedkv_np import ConfigError, DTypeError, PagedKVCache
from pagedkv_np.tiers import (FORMAT_VERSION, CorruptPage, DiskTier, PageFormat, decode_page,
                              encode_page, page_key, tier_scope)
from pagedkv_np.tiers.worker import WriteQueue

LAYERS, HEADS, DIM, PAGE = 2, 2, 8, 4


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def make_cache(directory, *, num_pages=32, dtype="float32", layout="NHD", model_id="model-a",
               **kw) -> PagedKVCache:
    return PagedKVCache(LAYERS, num_pages, PAGE, HEADS, DIM, dtype=dtype, layout=layout,
                        backend="numpy", disk_cache=str(directory), model_id=model_id, **kw)


def run_prompt(cache, prompt, expected_kv, salt=None):
    """Add ``prompt``, write the K/V of its uncached tokens, return the
    sequence (not released) and the tokens it was served from the cache."""
    seq = cache.add_sequence(prompt, salt=salt)
    n = seq.num_cached_tokens
    cache.extend(seq, prompt[n:])
    plan = cache.plan([seq])
    store_dtype = "float32" if cache.dtype.name == "int8" else cache.dtype
    for layer in range(cache.num_layers):
        k, v = expected_kv(prompt, salt, layer, HEADS, DIM, store_dtype)
        cache.write(layer, plan, np.ascontiguousarray(k[n:]), np.ascontiguousarray(v[n:]))
    return seq, n


def check_kv(cache, seq, prompt, expected_kv, salt=None, atol=0.0):
    """Every position of ``seq`` holds the K/V computed for its own prefix."""
    plan = cache.plan([seq])
    for layer in range(cache.num_layers):
        k, v = cache.gather(layer, plan, layout="BTHD", dtype=None if cache.dtype.name != "int8"
                            else "float32")
        ek, ev = expected_kv(prompt, salt, layer, HEADS, DIM, k.dtype)
        np.testing.assert_allclose(k[0, :len(prompt)].astype(np.float32),
                                   ek.astype(np.float32), atol=atol, rtol=0)
        np.testing.assert_allclose(v[0, :len(prompt)].astype(np.float32),
                                   ev.astype(np.float32), atol=atol, rtol=0)


PROMPT = list(range(100, 100 + 4 * PAGE + 3))     # 4 full pages and a tail


# ------------------------------------------------------------------ format
def _entry(**over):
    fmt = PageFormat(PAGE, "NHD", "float32", (((LAYERS, PAGE, HEADS, DIM), np.dtype("float32")),
                                              ((LAYERS, PAGE, HEADS, DIM), np.dtype("float32"))))
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal(s).astype(d) for s, d in fmt.parts]
    args = dict(key=b"k" * 20, digest=b"d" * 16, parent_digest=b"p" * 16,
                tokens=np.arange(PAGE, dtype="<i8").tobytes(), descr=fmt.descr, arrays=arrays)
    args.update(over)
    return fmt, arrays, encode_page(**args)


def test_an_entry_round_trips():
    fmt, arrays, blob = _entry()
    rec = decode_page(blob)
    assert (rec.key, rec.digest, rec.parent_digest) == (b"k" * 20, b"d" * 16, b"p" * 16)
    assert rec.tokens == np.arange(PAGE, dtype="<i8").tobytes()
    assert rec.descr == fmt.descr and f"v{FORMAT_VERSION}" in rec.descr
    for got, want in zip(fmt.split(rec.payload), arrays):
        assert np.array_equal(got, want)


@pytest.mark.parametrize("damage", ["truncate", "extend", "flip-payload", "flip-meta",
                                    "flip-crc", "magic", "version", "empty", "garbage"])
def test_a_damaged_entry_is_refused(damage):
    _, _, blob = _entry()
    b = bytearray(blob)
    if damage == "truncate":
        b = b[:len(b) // 2]
    elif damage == "extend":
        b += b"\0"
    elif damage == "flip-payload":
        b[len(b) - 100] ^= 0x10
    elif damage == "flip-meta":
        b[30] ^= 0x01
    elif damage == "flip-crc":
        b[-1] ^= 0x80
    elif damage == "magic":
        b[0:4] = b"XXXX"
    elif damage == "version":
        b[4] = FORMAT_VERSION + 1
    elif damage == "empty":
        b = bytearray()
    else:
        b = bytearray(os.urandom(len(b)))
    with pytest.raises(CorruptPage):
        decode_page(bytes(b))


def test_keys_cover_secret_scope_salt_and_digest():
    fmt = PageFormat.from_store(PagedKVCache(1, 2, PAGE, 1, 4, backend="numpy").store)
    scope = tier_scope("m", fmt)
    base = page_key(b"s" * 32, scope, b"", b"d" * 16)
    others = [page_key(b"t" * 32, scope, b"", b"d" * 16),
              page_key(b"s" * 32, tier_scope("m2", fmt), b"", b"d" * 16),
              page_key(b"s" * 32, scope, b"salt", b"d" * 16),
              page_key(b"s" * 32, scope, b"", b"e" * 16)]
    assert len(set([base] + others)) == 5 and len(base) == 20
    formats = {PageFormat.from_store(PagedKVCache(1, 2, ps, 1, 4, dtype=dt, layout=lay,
                                                  backend="numpy").store).descr
               for ps in (4, 8) for dt in ("float32", "float16", "int8") for lay in ("NHD", "HND")}
    assert len(formats) == 12   # page size, dtype and layout all reach the key's scope


# ------------------------------------------------------- cache round trips
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_restarted_cache_loads_verified_pages(tmp_path, expected_kv, dtype, layout):
    a = make_cache(tmp_path, dtype=dtype, layout=layout)
    seq_a, n = run_prompt(a, PROMPT, expected_kv)
    assert n == 0
    assert a.tiers.flush(10)
    assert a.stats.tiers["disk"]["pages_written"] == 4
    b = make_cache(tmp_path, dtype=dtype, layout=layout)
    seq_b = b.add_sequence(PROMPT)
    assert seq_b.num_cached_tokens == 4 * PAGE
    assert b.stats.tiers["disk"]["hits"] == 4 and b.stats.prefix_hit_tokens == 4 * PAGE
    # the loaded pages hold the writer's bytes exactly (codes and scales for int8)
    for pa, pb in zip(seq_a.page_ids[:4], seq_b.page_ids):
        assert np.array_equal(a.k_cache[:, pa], b.k_cache[:, pb])
        assert np.array_equal(a.v_cache[:, pa], b.v_cache[:, pb])
        if dtype == "int8":
            assert np.array_equal(a.store.k_scale[:, pa], b.store.k_scale[:, pb])
            assert np.array_equal(a.store.v_scale[:, pa], b.store.v_scale[:, pb])
    if dtype != "int8":   # (int8 pages are compared as codes and scales above)
        b.extend(seq_b, PROMPT[seq_b.num_cached_tokens:])
        plan = b.plan([seq_b])
        for layer in range(LAYERS):
            k, v = expected_kv(PROMPT, None, layer, HEADS, DIM, dtype)
            b.write(layer, plan, np.ascontiguousarray(k[16:]), np.ascontiguousarray(v[16:]))
        check_kv(b, seq_b, PROMPT, expected_kv)
    b.check_invariants()


def test_loaded_pages_hit_in_ram_afterwards(tmp_path, expected_kv):
    a = make_cache(tmp_path)
    run_prompt(a, PROMPT, expected_kv)
    a.tiers.flush(10)
    b = make_cache(tmp_path)
    seq, n = run_prompt(b, PROMPT, expected_kv)
    b.release(seq)
    reads = b.stats.tiers["disk"]["num_reads"]
    seq2 = b.add_sequence(PROMPT)
    assert seq2.num_cached_tokens == 4 * PAGE + 2    # full pages, then part of the tail
    assert b.stats.tiers["disk"]["num_reads"] == reads   # served from RAM, no tier read
    check_kv(b, seq2, PROMPT[:seq2.num_cached_tokens], expected_kv)
    b.check_invariants()


def test_salts_never_cross(tmp_path, expected_kv):
    a = make_cache(tmp_path)
    for salt in ("tenant-a", b"tenant-a", 7):
        run_prompt(a, PROMPT, expected_kv, salt=salt)
    a.tiers.flush(10)
    assert a.stats.tiers["disk"]["pages_written"] == 12     # one chain per salt
    b = make_cache(tmp_path)
    for salt in (None, "tenant-b", b"tenant-b", 8, "7"):
        seq = b.add_sequence(PROMPT, salt=salt)
        assert seq.num_cached_tokens == 0, salt
        b.release(seq)
    assert b.stats.tiers["disk"]["hits"] == 0
    for salt in ("tenant-a", b"tenant-a", 7):
        seq, n = run_prompt(b, PROMPT, expected_kv, salt=salt)
        assert n == 4 * PAGE
        check_kv(b, seq, PROMPT, expected_kv, salt=salt)


@pytest.mark.parametrize("other", [dict(model_id="model-b"), dict(hash_secret=b"x" * 32),
                                   dict(layout="HND"), dict(dtype="float16")])
def test_other_models_secrets_and_formats_never_load(tmp_path, expected_kv, other):
    a = make_cache(tmp_path)
    run_prompt(a, PROMPT, expected_kv)
    a.tiers.flush(10)
    b = make_cache(tmp_path, **other)
    seq = b.add_sequence(PROMPT)
    assert seq.num_cached_tokens == 0
    assert b.stats.tiers["disk"]["hits"] == 0 and b.stats.tiers["disk"]["rejected"] == 0


def test_an_entry_under_the_wrong_key_is_rejected_and_discarded(tmp_path, expected_kv):
    """A valid entry of another page, copied over this page's key: its CRC
    holds, but its key, digest and tokens do not match, so it is refused."""
    a = make_cache(tmp_path)
    run_prompt(a, PROMPT, expected_kv)
    a.tiers.flush(10)
    disk = a.tiers.tiers[0]
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(disk.root) for f in fs)
    assert len(files) == 4
    blobs = {p: read(p) for p in files}
    keys = {decode_page(b).key: p for p, b in blobs.items()}
    first = a.tiers.key(None, a.add_sequence(PROMPT)._digests[0])
    victim = keys[first]
    donor = next(p for p in files if p != victim)
    with open(victim, "wb") as f:
        f.write(blobs[donor])
    b = make_cache(tmp_path)
    seq, n = run_prompt(b, PROMPT, expected_kv)
    assert n == 0
    assert b.stats.tiers["disk"]["rejected"] == 1
    check_kv(b, seq, PROMPT, expected_kv)
    b.tiers.flush(10)      # discarded, then written again by the cache that recomputed it
    assert decode_page(read(victim)).key == first


def test_the_chain_stops_at_the_first_bad_page(tmp_path, expected_kv):
    a = make_cache(tmp_path)
    run_prompt(a, PROMPT, expected_kv)
    a.tiers.flush(10)
    probe = a.add_sequence(PROMPT)
    third = a.tiers.tiers[0]._path(a.tiers.key(None, probe._digests[2]))
    with open(third, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 1]))
    b = make_cache(tmp_path)
    seq, n = run_prompt(b, PROMPT, expected_kv)
    assert n == 2 * PAGE
    s = b.stats.tiers["disk"]
    assert s["hits"] == 2 and s["rejected"] == 1 and s["misses"] == 1
    check_kv(b, seq, PROMPT, expected_kv)


def test_a_full_pool_loads_only_what_fits(tmp_path, expected_kv):
    a = make_cache(tmp_path)
    run_prompt(a, PROMPT, expected_kv)
    a.tiers.flush(10)
    b = make_cache(tmp_path, num_pages=6)
    hold = b.add_sequence([1] * (4 * PAGE))
    b.extend(hold, [1] * (4 * PAGE))          # 4 of the 6 pages in use
    seq = b.add_sequence(PROMPT)
    assert seq.num_cached_tokens == 2 * PAGE
    assert b.num_free_pages == 0
    b.check_invariants()


def test_a_full_write_queue_drops_and_counts(tmp_path, expected_kv):
    c = make_cache(tmp_path, tier_options={"queue_size": 1})
    with c._lock:      # the writer cannot copy pages while the cache is held
        run_prompt(c, PROMPT, expected_kv)
        drops = c.stats.tiers["disk"]["drops"]
    assert drops >= 2
    c.tiers.flush(10)
    s = c.stats.tiers["disk"]
    assert s["pages_written"] + s["drops"] >= 4 and s["pages_written"] >= 1
    # every page that was written is correct: a restarted cache checks it all
    b = make_cache(tmp_path)
    seq, n = run_prompt(b, PROMPT, expected_kv)
    check_kv(b, seq, PROMPT, expected_kv)
    assert b.stats.tiers["disk"]["rejected"] == 0


def test_dropped_pages_are_written_when_evicted(tmp_path, expected_kv):
    c = make_cache(tmp_path, num_pages=6, tier_options={"queue_size": 1})
    with c._lock:
        seq, _ = run_prompt(c, PROMPT, expected_kv)
        c.release(seq)
        drops = c.stats.tiers["disk"]["drops"]
    assert drops >= 2
    c.tiers.flush(10)
    c.tiers._queue.maxsize = 64       # room now, for the pages offered again
    other = list(range(500, 500 + 6 * PAGE))
    s = c.add_sequence(other)
    c.extend(s, other)                # takes every page: the prompt's are evicted
    c.tiers.flush(10)
    assert c.stats.tiers["disk"]["pages_written"] == 4
    b = make_cache(tmp_path)
    seq, n = run_prompt(b, PROMPT, expected_kv)
    assert n == 4 * PAGE
    check_kv(b, seq, PROMPT, expected_kv)


def test_a_page_evicted_before_the_writer_copies_it_is_still_written(tmp_path, expected_kv):
    c = make_cache(tmp_path, num_pages=5)
    with c._lock:
        seq, _ = run_prompt(c, PROMPT, expected_kv)
        c.release(seq)
        big = list(range(900, 900 + 5 * PAGE))
        s = c.add_sequence(big)
        c.extend(s, big)      # takes every page: the prompt's are reused
    c.tiers.flush(10)
    b = make_cache(tmp_path)
    seq, n = run_prompt(b, PROMPT, expected_kv)
    assert n == 4 * PAGE
    check_kv(b, seq, PROMPT, expected_kv)


def test_threads_adding_and_loading_at_once(tmp_path, expected_kv):
    a = make_cache(tmp_path)
    run_prompt(a, PROMPT, expected_kv)
    a.tiers.flush(10)
    b = make_cache(tmp_path, num_pages=64)
    errors: list = []

    def worker():
        try:
            for _ in range(5):
                with b._lock:
                    seq, n = run_prompt(b, PROMPT, expected_kv)
                    check_kv(b, seq, PROMPT, expected_kv)
                    b.release(seq)
        except Exception as exc:     # reported below
            errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    b.check_invariants()


# ------------------------------------------------------------- write queue
def test_write_queue_is_bounded_and_flushes():
    seen: list = []
    gate = threading.Event()

    def handler(batch):
        gate.wait()
        seen.extend(batch)
    q = WriteQueue(3, handler, batch_size=2)
    accepted = [q.submit(i) for i in range(10)]
    assert sum(accepted) <= 5          # 3 queued, at most a batch of 2 taken
    assert not q.flush(0.05)
    gate.set()
    assert q.flush(5)
    assert sorted(seen) == [i for i, ok in enumerate(accepted) if ok]
    q.close()
    assert not q.submit(99)


def test_a_failing_handler_does_not_stop_the_queue():
    seen: list = []

    def handler(batch):
        if 0 in batch:
            raise OSError("disk gone")
        seen.extend(batch)
    q = WriteQueue(8, handler, batch_size=1)
    for i in range(3):
        q.submit(i)
    assert q.flush(5)
    assert seen == [1, 2]
    q.close()


# --------------------------------------------------- the malformed calls
def _file(tmp_path):
    p = tmp_path / "a-file"
    p.write_bytes(b"x")
    return str(p)


BAD = [
    ("disk-dir-int", lambda t: dict(disk_cache=3), DTypeError, "disk_cache"),
    ("disk-dir-is-a-file", lambda t: dict(disk_cache=_file(t)), ConfigError, "disk_cache"),
    ("disk-dir-under-a-file", lambda t: dict(disk_cache=_file(t) + "/sub"), ConfigError,
     "disk_cache"),
    ("disk-dir-nul", lambda t: dict(disk_cache=str(t) + "/a\0b"), ConfigError, "disk_cache"),
    ("disk-bytes-negative", lambda t: dict(disk_cache=str(t), disk_cache_bytes=-1), ConfigError,
     "disk_cache_bytes"),
    ("disk-bytes-zero", lambda t: dict(disk_cache=str(t), disk_cache_bytes=0), ConfigError,
     "disk_cache_bytes"),
    ("disk-bytes-float", lambda t: dict(disk_cache=str(t), disk_cache_bytes=1.5), DTypeError,
     "disk_cache_bytes"),
    ("disk-bytes-alone", lambda t: dict(disk_cache_bytes=100), ConfigError, "disk_cache_bytes"),
    ("no-model-id", lambda t: dict(disk_cache=str(t), model_id=None), ConfigError, "model_id"),
    ("model-id-bytes", lambda t: dict(disk_cache=str(t), model_id=b"m"), ConfigError,
     "model_id"),
    ("redis-url-int", lambda t: dict(redis_url=6379, hash_secret=b"s"), DTypeError, "redis_url"),
    ("redis-url-scheme", lambda t: dict(redis_url="http://127.0.0.1:6379", hash_secret=b"s"),
     ConfigError, "redis_url"),
    ("redis-url-port", lambda t: dict(redis_url="redis://127.0.0.1:notaport/0",
                                      hash_secret=b"s"), ConfigError, "redis_url"),
    ("redis-url-db", lambda t: dict(redis_url="redis://127.0.0.1:6379/x", hash_secret=b"s"),
     ConfigError, "redis_url"),
    ("redis-no-secret", lambda t: dict(redis_url="redis://127.0.0.1:6379/0"), ConfigError,
     "hash_secret"),
    ("redis-timeout-negative", lambda t: dict(redis_url="redis://127.0.0.1:1/0", hash_secret=b"s",
                                              tier_options={"redis": {"timeout": -1}}),
     ConfigError, "timeout"),
    ("redis-option-unknown", lambda t: dict(redis_url="redis://127.0.0.1:1/0", hash_secret=b"s",
                                            tier_options={"redis": {"colour": 1}}),
     DTypeError, "redis"),
    ("options-not-dict", lambda t: dict(disk_cache=str(t), tier_options=[1]), DTypeError,
     "tier_options"),
    ("options-unknown", lambda t: dict(disk_cache=str(t), tier_options={"speed": 1}),
     ConfigError, "tier_options"),
    ("queue-size-negative", lambda t: dict(disk_cache=str(t), tier_options={"queue_size": -5}),
     ConfigError, "queue_size"),
    ("read-timeout-zero", lambda t: dict(disk_cache=str(t), tier_options={"read_timeout": 0}),
     ConfigError, "read_timeout"),
]


@pytest.mark.parametrize("name,kwargs,err,match", BAD, ids=[b[0] for b in BAD])
def test_bad_tier_arguments_raise_typed_errors(tmp_path, name, kwargs, err, match):
    kw = dict(model_id="m")
    kw.update(kwargs(tmp_path))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(err, match=match):
        PagedKVCache(LAYERS, 8, PAGE, HEADS, DIM, backend="numpy", **kw)
    if name.startswith("disk-dir") or name.startswith("redis"):
        assert sorted(os.listdir(tmp_path)) == before


def test_disk_tier_bounds_its_bytes(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=10_000)
    blobs = [(bytes([i]) * 20, os.urandom(3000)) for i in range(10)]
    for item in blobs:
        assert tier.put([item]) == [True]
    assert tier.num_bytes <= 10_000
    # the most recent entries are the ones kept
    assert tier.get([blobs[-1][0]]) == [blobs[-1][1]]
    assert tier.get([blobs[0][0]]) == [None]
    assert tier.put([(b"z" * 20, os.urandom(20_000))]) == [False]   # larger than the bound


def test_disk_tier_contains_get_put_discard(tmp_path):
    tier = DiskTier(tmp_path, max_bytes=1 << 20)
    keys = [bytes([i]) * 20 for i in range(3)]
    assert tier.contains(keys) == [False] * 3
    assert tier.put([(keys[0], b"zero"), (keys[2], memoryview(b"two"))]) == [True, True]
    assert tier.contains(keys) == [True, False, True]
    assert tier.get(keys) == [b"zero", None, b"two"]
    tier.discard(keys[:2])
    assert tier.contains(keys) == [False, False, True]
    # another process's tier on the same directory sees the same entries
    assert DiskTier(tmp_path, max_bytes=1 << 20).get(keys[2:]) == [b"two"]
