"""The preallocated K/V store."""

import numpy as np
import pytest

from pagedkv_np import get_backend
from pagedkv_np.errors import ConfigError, DTypeError, LayoutError
from pagedkv_np.layout import StoreLayout, resolve_dtype
from pagedkv_np.store import KVStore

NUMPY = get_backend("numpy")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout, shape", [("NHD", (2, 5, 4, 3, 8)), ("HND", (2, 5, 3, 4, 8))])
def test_store_shape_dtype_and_zero_fill(dtype, layout, shape):
    store = KVStore(2, 4, 3, 8, num_pages=5, dtype=dtype, layout=layout, backend=NUMPY)
    assert store.shape == shape
    assert store.k.shape == store.v.shape == shape
    assert store.k.dtype == store.v.dtype == resolve_dtype(dtype) == store.dtype
    assert store.layout is StoreLayout(layout)
    assert store.k.flags.c_contiguous and store.k.flags.writeable
    assert not np.shares_memory(store.k, store.v)
    assert not store.k.view(np.uint8).any() and not store.v.view(np.uint8).any()
    itemsize = resolve_dtype(dtype).itemsize
    assert store.nbytes == 2 * int(np.prod(shape)) * itemsize
    assert store.nbytes == store.num_pages * KVStore.bytes_per_page(2, 4, 3, 8, dtype)


@pytest.mark.parametrize("backend", ["numpy", "numba"])
@pytest.mark.parametrize("num_pages", [1, 7, 4096])
def test_host_stores_and_outputs_start_on_a_cache_line(backend, num_pages):
    # so that each K/V row of 64-byte multiples fills whole cache lines
    be = get_backend(backend)
    store = KVStore(1, 16, 8, 128, num_pages=num_pages, dtype="float16", backend=be)
    assert store.k.ctypes.data % 64 == 0 and store.v.ctypes.data % 64 == 0
    assert store.k.nbytes == num_pages * 16 * 8 * 128 * 2
    k, v = be.gather(store.k, store.v, 0, np.zeros((3, 1), np.int32),
                     np.array([16, 5, 0], np.int32))
    assert k.ctypes.data % 64 == 0 and v.ctypes.data % 64 == 0
    assert k.shape == (3, 16, 8, 128) and not k.view(np.uint16)[1, 5:].any()


def test_bytes_per_page():
    assert KVStore.bytes_per_page(2, 16, 4, 64, "float16") == 2 * 2 * 16 * 4 * 64 * 2
    assert KVStore.bytes_per_page(1, 1, 1, 1, "float32") == 8


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_bytes_gives_the_largest_count_that_fits(dtype):
    per_page = KVStore.bytes_per_page(3, 8, 2, 16, dtype)
    for budget, pages in [(per_page, 1), (per_page * 10, 10), (per_page * 10 + per_page - 1, 10)]:
        store = KVStore(3, 8, 2, 16, memory_bytes=budget, dtype=dtype, backend=NUMPY)
        assert store.num_pages == pages
        assert store.nbytes <= budget < store.nbytes + per_page


def test_memory_bytes_too_small_for_one_page():
    per_page = KVStore.bytes_per_page(1, 4, 1, 4, "float32")
    with pytest.raises(ConfigError, match=f"memory_bytes.*{per_page}"):
        KVStore(1, 4, 1, 4, memory_bytes=per_page - 1, backend=NUMPY)


@pytest.mark.parametrize("kwargs", [{}, {"num_pages": 4, "memory_bytes": 1 << 20}])
def test_exactly_one_of_num_pages_and_memory_bytes(kwargs):
    with pytest.raises(ConfigError, match="num_pages.*memory_bytes"):
        KVStore(1, 4, 1, 4, backend=NUMPY, **kwargs)


def test_slot_ids_must_fit_in_int32():
    # Checked before anything is allocated: this store would be petabytes.
    with pytest.raises(ConfigError, match="num_pages"):
        KVStore(1, 1 << 20, 1, 1, num_pages=1 << 12, backend=NUMPY)


@pytest.mark.parametrize("name, value, error", [
    ("num_layers", 0, ConfigError), ("page_size", -1, ConfigError),
    ("num_kv_heads", 1.0, DTypeError), ("head_dim", None, DTypeError),
    ("num_pages", 0, ConfigError), ("num_pages", True, DTypeError),
    ("memory_bytes", 0, ConfigError), ("memory_bytes", 1.5e6, DTypeError),
    ("dtype", "float64", DTypeError), ("layout", "NDH", LayoutError),
])
def test_bad_arguments_name_themselves(name, value, error):
    kwargs = dict(num_layers=1, page_size=4, num_kv_heads=1, head_dim=4, num_pages=4,
                  dtype="float32", layout="NHD")
    if name == "memory_bytes":
        kwargs.pop("num_pages")
    kwargs[name] = value
    with pytest.raises(error, match=name):
        KVStore(backend=NUMPY, **kwargs)


def test_repr():
    store = KVStore(1, 2, 1, 2, num_pages=3, dtype="float16", layout="HND", backend=NUMPY)
    assert repr(store) == "KVStore(shape=[1, 3, 1, 2, 2], dtype=float16, layout=HND, nbytes=48)"
