"""The cache reaches its backend through the public methods only.

A spy backend (the NumPy reference with every public method and kernel
recorded) shows that each kernel call happens inside the public method of
the same operation, with the cache's "already checked" flags and the plan's
prepared indices; a backend that overrides ``write`` to take inputs the base
class would refuse proves that the override runs; a backend whose prepared
indices count their conversions shows one conversion per plan, not one per
layer.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv_np import PagedKVCache
from pagedkv_np.backends import PreparedIndices
from pagedkv_np.backends.numpy_ref import NumpyBackend
from pagedkv_np.errors import ConfigError, DTypeError

from helpers import bits

NUM_LAYERS, PAGE_SIZE, HEADS, HEAD_DIM = 3, 4, 2, 32

_KERNEL_OF = {"write": "_write", "gather": "_gather", "copy_pages": "_copy_pages",
              "write_quantized": "_write_quantized", "gather_quantized": "_gather_quantized"}


class SpyBackend(NumpyBackend):
    """The NumPy reference, recording each public call with its keywords and
    each kernel call with the public call it ran inside."""

    name = "spy"

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []
        self.kernels: list[tuple[str, str | None]] = []
        self.prepared: list[PreparedIndices] = []
        self._inside: str | None = None
        self._in_kernel = False

    def prepare(self, plan):
        prepared = super().prepare(plan)
        self.prepared.append(prepared)
        return prepared

    def _public(self, name, *args, **kwargs):
        self.calls.append((name, kwargs))
        outer, self._inside = self._inside, name
        try:
            return getattr(super(), name)(*args, **kwargs)
        finally:
            self._inside = outer

    def write(self, *args, **kwargs):
        return self._public("write", *args, **kwargs)

    def gather(self, *args, **kwargs):
        return self._public("gather", *args, **kwargs)

    def copy_pages(self, *args, **kwargs):
        return self._public("copy_pages", *args, **kwargs)

    def write_quantized(self, *args, **kwargs):
        return self._public("write_quantized", *args, **kwargs)

    def gather_quantized(self, *args, **kwargs):
        return self._public("gather_quantized", *args, **kwargs)

    def _kernel(self, name, *args):
        # the reference's int8 kernels reuse its float ones: record the outer one
        if self._in_kernel:
            return getattr(super(), name)(*args)
        self.kernels.append((name, self._inside))
        self._in_kernel = True
        try:
            getattr(super(), name)(*args)
        finally:
            self._in_kernel = False

    def _write(self, *args):
        self._kernel("_write", *args)

    def _gather(self, *args):
        self._kernel("_gather", *args)

    def _copy_pages(self, *args):
        self._kernel("_copy_pages", *args)

    def _write_quantized(self, *args):
        self._kernel("_write_quantized", *args)

    def _gather_quantized(self, *args):
        self._kernel("_gather_quantized", *args)


def run_steps(cache, rng):
    """Two sequences sharing a prompt prefix: prefill, a fork that copies a
    partial page, a decode step; returns every gathered array."""
    gathered = []
    prompt = rng.integers(0, 1000, 10)
    a = cache.add_sequence(prompt)
    cache.extend(a, prompt)

    def step(seqs):
        plan = cache.plan(seqs)
        for layer in range(cache.num_layers):
            k = rng.standard_normal((plan.num_new_tokens, HEADS, HEAD_DIM)).astype(np.float32)
            v = rng.standard_normal(k.shape).astype(np.float32)
            if cache.store.quant is None:
                k, v = k.astype(cache.dtype), v.astype(cache.dtype)
            cache.write(layer, plan, k, v)
        for layer in range(cache.num_layers):
            gathered.extend(cache.backend.to_numpy(x) for x in cache.gather(layer, plan))

    step([a])
    b = cache.fork(a)
    for seq in (a, b):
        cache.extend(seq, rng.integers(0, 1000, 1))
    step([a, b])   # b's first write copies the shared partial page
    return gathered


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_every_kernel_runs_inside_its_public_method(dtype):
    spy = SpyBackend()
    cache = PagedKVCache(NUM_LAYERS, 16, PAGE_SIZE, HEADS, HEAD_DIM, dtype=dtype, backend=spy)
    ref = PagedKVCache(NUM_LAYERS, 16, PAGE_SIZE, HEADS, HEAD_DIM, dtype=dtype,
                       backend="numpy")
    got = run_steps(cache, np.random.default_rng(0))
    want = run_steps(ref, np.random.default_rng(0))
    assert len(got) == len(want) == 4 * NUM_LAYERS
    for g, w in zip(got, want):
        np.testing.assert_array_equal(bits(g), bits(w))

    writes = "write_quantized" if dtype == "int8" else "write"
    gathers = "gather_quantized" if dtype == "int8" else "gather"
    names = [name for name, _ in spy.calls]
    assert names.count(writes) == names.count(gathers) == 2 * NUM_LAYERS
    assert "copy_pages" in names                      # the fork's copy-on-write
    assert spy.kernels and all(outer is not None and _KERNEL_OF[outer] == kernel
                               for kernel, outer in spy.kernels)
    assert len(spy.kernels) == len(spy.calls)         # nothing else reached a kernel
    # two plans, each prepared once and handed to each of its writes and gathers
    assert len(spy.prepared) == 2
    for name, kwargs in spy.calls:
        assert kwargs["check_store"] is False and kwargs["check_indices"] is False
        if name in (writes, gathers):
            assert kwargs["prepared"] in spy.prepared
    per_plan = [sum(kw.get("prepared") is p for _, kw in spy.calls) for p in spy.prepared]
    assert per_plan == [2 * NUM_LAYERS, 2 * NUM_LAYERS]


class ListInputBackend(NumpyBackend):
    """A backend whose ``write`` also takes nested lists, as CuPy's takes host
    arrays: the cache must call this override, not the kernel beneath it."""

    name = "lists"

    def write(self, k_cache, v_cache, layer, slot_mapping, k, v, **kwargs):
        k, v = (np.asarray(x, dtype=k_cache.dtype) if isinstance(x, list) else x
                for x in (k, v))
        super().write(k_cache, v_cache, layer, slot_mapping, k, v, **kwargs)


def test_a_backend_override_of_write_runs_for_the_cache():
    rng = np.random.default_rng(1)
    cache = PagedKVCache(2, 8, PAGE_SIZE, HEADS, HEAD_DIM, dtype="float32",
                         backend=ListInputBackend())
    prompt = rng.integers(0, 100, 6)
    seq = cache.add_sequence(prompt)
    cache.extend(seq, prompt)
    plan = cache.plan([seq])
    k = rng.standard_normal((6, HEADS, HEAD_DIM)).astype(np.float32)
    for layer in range(2):
        cache.write(layer, plan, k.tolist(), (k + layer).tolist())
    for layer in range(2):
        got_k, got_v = cache.gather(layer, plan, layout="BTHD")
        np.testing.assert_array_equal(got_k[0], k)
        np.testing.assert_array_equal(got_v[0], k + layer)
    # the plain NumPy backend refuses the same lists, and keeps its store as it was
    plain = PagedKVCache(2, 8, PAGE_SIZE, HEADS, HEAD_DIM, dtype="float32", backend="numpy")
    seq = plain.add_sequence(np.arange(6))
    plain.extend(seq, np.arange(6))
    plan = plain.plan([seq])
    before = plain.k_cache.copy()
    with pytest.raises(DTypeError, match="Invalid k: expected an array"):
        plain.write(0, plan, k.tolist(), k.tolist())
    np.testing.assert_array_equal(plain.k_cache, before)


class CountingIndices(PreparedIndices):
    """Prepared indices that convert each array once and keep the result,
    counting conversions, as CuPy's DeviceIndices keeps one upload per GPU."""

    __slots__ = ("converted", "kept")

    def __init__(self, plan):
        super().__init__(plan)
        self.converted: dict[str, int] = {}
        self.kept: dict[int, np.ndarray] = {}

    def kernel_form(self, host):
        if id(host) not in self.kept:
            name = next(n for n in ("slot_mapping", "page_table", "seq_lens")
                        if getattr(self, n) is host)
            self.converted[name] = self.converted.get(name, 0) + 1
            self.kept[id(host)] = host.copy()   # as an upload makes a copy
        return self.kept[id(host)]


class CountingBackend(NumpyBackend):
    name = "counting"

    def __init__(self) -> None:
        self.prepared: list[CountingIndices] = []

    def prepare(self, plan):
        self.prepared.append(CountingIndices(plan))
        return self.prepared[-1]

    def _write(self, k_cache, v_cache, layer, slot_mapping, k, v, layout):
        assert any(slot_mapping is p.kept.get(id(p.slot_mapping)) for p in self.prepared)
        super()._write(k_cache, v_cache, layer, slot_mapping, k, v, layout)


def test_prepared_indices_are_converted_once_per_plan_not_per_layer():
    backend = CountingBackend()
    cache = PagedKVCache(NUM_LAYERS, 8, PAGE_SIZE, HEADS, HEAD_DIM, backend=backend)
    seq = cache.add_sequence(np.arange(5))
    cache.extend(seq, np.arange(5))
    plan = cache.plan([seq])
    (prepared,) = backend.prepared
    k = np.ones((5, HEADS, HEAD_DIM), np.float32)
    for layer in range(NUM_LAYERS):
        cache.write(layer, plan, k * layer, k)
    for layer in range(NUM_LAYERS):
        got, _ = cache.gather(layer, plan, layout="BTHD")
        np.testing.assert_array_equal(got[0], k * layer)
    assert prepared.converted == {"slot_mapping": 1, "page_table": 1, "seq_lens": 1}
    cache.extend(seq, [7])
    cache.plan([seq])
    assert len(backend.prepared) == 2   # a new plan, prepared anew


def _plan_of_one():
    cache = PagedKVCache(1, 4, PAGE_SIZE, HEADS, HEAD_DIM, backend="numpy")
    seq = cache.add_sequence(np.arange(3))
    cache.extend(seq, np.arange(3))
    return cache.plan([seq])


def test_prepared_indices_of_another_plan_are_refused_and_change_nothing():
    backend = NumpyBackend()
    cache = PagedKVCache(1, 8, PAGE_SIZE, HEADS, HEAD_DIM, backend=backend)
    seq = cache.add_sequence(np.arange(5))
    cache.extend(seq, np.arange(5))
    plan = cache.plan([seq])
    other = backend.prepare(_plan_of_one())
    k = np.ones((5, HEADS, HEAD_DIM), np.float32)
    store = cache.store
    before = store.k.copy()
    with pytest.raises(ConfigError, match="Invalid prepared: it was made from another plan"):
        backend.write(store.k, store.v, 0, plan.slot_mapping, k, k, layout=store.layout,
                      prepared=other)
    with pytest.raises(ConfigError, match="Invalid prepared"):
        backend.gather(store.k, store.v, 0, plan.page_table, plan.seq_lens, layout=store.layout,
                       prepared=other)
    with pytest.raises(DTypeError, match="Invalid prepared: expected the result of prepare"):
        backend.write(store.k, store.v, 0, plan.slot_mapping, k, k, layout=store.layout,
                      prepared=plan)
    with pytest.raises(ConfigError, match="Invalid plan: expected an object with a slot_mapping"):
        backend.prepare(object())
    np.testing.assert_array_equal(store.k, before)
    # its own plan's prepared form is taken, and writes what the plain call writes
    backend.write(store.k, store.v, 0, plan.slot_mapping, k, k, layout=store.layout,
                  prepared=backend.prepare(plan))
    got, _ = cache.gather(0, cache.plan([seq]), layout="BTHD")
    np.testing.assert_array_equal(got[0], k)


def test_prepare_checks_the_index_arrays_of_an_object_that_is_not_a_plan():
    import types

    from pagedkv_np.errors import ShapeError

    good = _plan_of_one()
    fields = dict(slot_mapping=good.slot_mapping, page_table=good.page_table,
                  seq_lens=good.seq_lens)
    backend = NumpyBackend()
    prepared = backend.prepare(types.SimpleNamespace(**fields))
    assert prepared.get(good.slot_mapping) is good.slot_mapping
    for name, bad, error in (("slot_mapping", good.slot_mapping.astype(np.int64), DTypeError),
                             ("page_table", good.page_table.ravel(), ShapeError),
                             ("seq_lens", good.seq_lens.tolist(), DTypeError)):
        with pytest.raises(error, match=name):
            backend.prepare(types.SimpleNamespace(**{**fields, name: bad}))
