"""Fixtures shared by the test modules.

``expected_kv`` gives the K/V a model would compute for a token sequence:
position ``t`` is a deterministic function of (salt, layer, tokens[:t + 1]), as
with a real model, where K at position t depends on every earlier token. A page
served by the prefix index therefore holds exactly what the sequence would have
written itself, and a page computed under another prefix, salt or position
shows up as a data mismatch.

``cache_state`` snapshots everything a PagedKVCache, PagedCache or PagePool
owns, for "an error changed nothing" checks.

``cache_backend`` runs a test once per built-in backend (ids ``numpy``,
``numba``, ``cupy``); a backend that cannot run on this machine is skipped
with the reason its :class:`BackendUnavailable` gives.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from pagedkv_np.backends import get_backend
from pagedkv_np.errors import BackendUnavailable
from pagedkv_np.layout import resolve_dtype

from helpers import CACHE_BACKENDS, bits


def _numba_cache_per_worker() -> None:
    """Under pytest-xdist, each worker compiles Numba kernels into a cache
    directory of its own. Numba's on-disk cache is not safe for two processes
    compiling the same function at once: each numbers its overloads from its
    own index, so one can overwrite the other's ``.nbc`` file and later load
    code compiled for other argument types ("can't unbox array"). Set before
    any kernel is decorated (the directory is read once per process);
    subprocesses that tests start inherit it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    from pagedkv_np.backends import jit

    base = (os.environ.get(jit.ENV_CACHE_DIR) or os.environ.get("NUMBA_CACHE_DIR")
            or jit._default_cache_dir())
    if base:
        os.environ[jit.ENV_CACHE_DIR] = os.path.join(base, f"xdist-{worker}")


_numba_cache_per_worker()

# Largest modulus whose integers are exact in each dtype (so values survive the
# round trip through float16 and bfloat16 unchanged).
_EXACT = {"float32": 1 << 20, "float16": 1 << 11, "bfloat16": 1 << 8}
_M64 = (1 << 64) - 1


def _prefix_hashes(tokens, salt) -> np.ndarray:
    """uint64 [T]: a rolling hash of (salt, tokens[:t + 1]) for every t."""
    h = (zlib.crc32(repr(salt).encode()) << 32) | 1
    out = np.empty(len(tokens), dtype=np.uint64)
    for t, tok in enumerate(np.asarray(tokens, dtype=np.int64).tolist()):
        h = ((h ^ (tok + 0x9E37)) * 0x100000001B3) & _M64
        h ^= h >> 29
        out[t] = h
    return out


def expected_kv_values(tokens, salt, layer: int, num_kv_heads: int, head_dim: int,
                       dtype) -> tuple[np.ndarray, np.ndarray]:
    """K and V, each ``[len(tokens), num_kv_heads, head_dim]`` of ``dtype``."""
    dtype = resolve_dtype(dtype)
    modulus = _EXACT[dtype.name]
    h = _prefix_hashes(tokens, salt)[:, None, None]
    elem = np.arange(num_kv_heads * head_dim, dtype=np.uint64).reshape(1, num_kv_heads, head_dim)
    with np.errstate(over="ignore"):
        mixed = h * np.uint64(0xC2B2AE3D27D4EB4F) + elem * np.uint64(0x165667B19E3779F9) \
            + np.uint64(layer * 0x27D4EB2F + 1)
        mixed ^= mixed >> np.uint64(31)
        k = (mixed % np.uint64(modulus)).astype(np.int64) - modulus // 2
        mixed = mixed * np.uint64(0x9E3779B97F4A7C15)
        mixed ^= mixed >> np.uint64(29)
        v = (mixed % np.uint64(modulus)).astype(np.int64) - modulus // 2
    return k.astype(np.float32).astype(dtype), v.astype(np.float32).astype(dtype)


def snapshot(obj) -> dict:
    """Everything a cache (either API) or a pool owns, copied."""
    from pagedkv_np import PagedCache, PagedKVCache
    from pagedkv_np.pool import PagePool

    state: dict = {}
    if isinstance(obj, PagePool):
        pool = obj
    elif isinstance(obj, PagedKVCache):
        pool = obj.pool
        index = obj.index
        state["seqs"] = {
            sid: (s.page_ids, s.num_tokens, s.num_computed_tokens, s.num_cached_tokens,
                  s.token_bytes(0, s.num_tokens), s.is_released, s.num_indexed_pages,
                  *map(tuple, s.links()))
            for sid, s in obj._live.items()}
        state["epoch"] = obj._epoch
        state["k"] = np.array(obj.backend.to_numpy(obj.k_cache))   # a host copy
        state["v"] = np.array(obj.backend.to_numpy(obj.v_cache))
    elif isinstance(obj, PagedCache):
        pool = obj._pool
        index = obj._index
        state["counters"] = (obj.lookup_hits, obj.lookup_misses)
        state["k"] = np.array(obj._backend.to_numpy(obj.k_cache))
        state["v"] = np.array(obj._backend.to_numpy(obj.v_cache))
    else:  # pragma: no cover - a test bug
        raise TypeError(type(obj))
    if not isinstance(obj, PagePool):
        state["index"] = {pid: (e.digest, e.tokens, e.parent) for pid, e in index._entries.items()}
        state["by_hash"] = dict(index._by_hash)
        state["generation"] = dict(index._generation)
        state["index_counters"] = (index.hit_tokens, index.query_tokens, index.num_rejected)
    state["pool"] = (list(pool._ref), bytes(pool._state), bytes(pool._cached), list(pool._free),
                     list(pool._prev), list(pool._next), pool._num_evictable)
    return state


def assert_same_state(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        if isinstance(before[key], np.ndarray):
            assert np.array_equal(bits(before[key]), bits(after[key])), f"{key} changed"
        else:
            assert before[key] == after[key], f"{key} changed"


@pytest.fixture
def expected_kv():
    """``expected_kv(tokens, salt, layer, num_kv_heads, head_dim, dtype) -> (k, v)``."""
    return expected_kv_values


@pytest.fixture
def state_of():
    """``state_of(cache_or_pool) -> dict``; compare two with ``same_state``."""
    return snapshot


@pytest.fixture
def same_state():
    """``same_state(before, after)`` asserts two ``state_of`` snapshots agree."""
    return assert_same_state


def _unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here, or None when it can."""
    try:
        get_backend(name)
    except BackendUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture(params=CACHE_BACKENDS)
def cache_backend(request) -> str:
    """The name of each built-in backend in turn; one that is unavailable on
    this machine skips, with the reason it is unavailable."""
    reason = _unavailable(request.param)
    if reason is not None:
        pytest.skip(reason)
    return request.param


@pytest.fixture(scope="session")
def examples_per_backend():
    """``examples_per_backend(n) -> int``: a share of an example budget of
    ``n`` for each backend that runs here, so that running over every
    backend keeps the total number of examples (and the run time) at ``n``."""
    num_running = sum(_unavailable(name) is None for name in CACHE_BACKENDS)

    def share(n: int) -> int:
        return max(1, -(-n // max(1, num_running)))
    return share
