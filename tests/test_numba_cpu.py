"""Tests of what is particular to the numba backend: its choice between serial
and parallel kernels and between ordinary and streaming stores, the JIT cache
policy, ``warmup``, bounds checking, and life without Numba.

(Agreement with the NumPy reference over dtypes, layouts and page sizes is in
``test_backends.py``; here every path is forced on purpose.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest

import pagedkv_np as pk
from pagedkv_np import DTypeError, KVStore, LayoutError
from pagedkv_np.backends import _numba_kernels as kernels
from pagedkv_np.backends import numba_cpu
from pagedkv_np.backends.numpy_ref import NumpyBackend
from pagedkv_np.layout import bits_view_dtype, resolve_dtype

REF = NumpyBackend()
NUMBA = pk.get_backend("numba")
HUGE = 1 << 62
PATHS = {  # name -> (PARALLEL_MIN_BYTES, STREAM_MIN_BYTES and WRITE_STREAM_MIN_BYTES)
    "serial": (HUGE, HUGE),
    "serial-stream": (HUGE, 0),
    "parallel": (0, HUGE),
    "parallel-stream": (0, 0),
}


def random_bits(rng, shape, dtype) -> np.ndarray:
    dtype = resolve_dtype(dtype)
    bits = bits_view_dtype(dtype)
    return rng.integers(0, np.iinfo(bits).max, size=shape, dtype=bits, endpoint=True).view(dtype)


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(a.view(bits_view_dtype(a.dtype)),
                                  b.view(bits_view_dtype(b.dtype)))


def misaligned(shape, dtype, byte_offset: int, fill) -> np.ndarray:
    """A C-contiguous array that starts ``byte_offset`` bytes into its buffer."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.empty(nbytes + 64, np.uint8)
    start = (-buf.ctypes.data) % 64 + byte_offset
    x = buf[start:start + nbytes].view(dtype).reshape(shape)
    x[...] = fill
    return x


class Spy:
    """Records which kernel ran, with its flags, and runs it."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, int]] = []
        for name in ("write_serial", "write_parallel", "gather_serial", "gather_parallel",
                     "copy_pages_serial", "copy_pages_parallel"):
            monkeypatch.setattr(kernels, name, self._wrap(name, getattr(kernels, name)))

    def _wrap(self, name, kernel):
        def run(*args):
            self.calls.append((name, args[-1]))
            return kernel(*args)
        return run


@pytest.fixture
def force_path(monkeypatch):
    def force(path: str) -> None:
        parallel_min, stream_min = PATHS[path]
        monkeypatch.setattr(numba_cpu, "PARALLEL_MIN_BYTES", parallel_min)
        monkeypatch.setattr(numba_cpu, "PARALLEL_MIN_THREADS", 1)  # also on 1 core
        monkeypatch.setattr(numba_cpu, "STREAM_MIN_BYTES", stream_min)
        monkeypatch.setattr(numba_cpu, "WRITE_STREAM_MIN_BYTES", stream_min)
    return force


def expected_kernel(op: str, path: str) -> tuple[str, bool]:
    return f"{op}_{'parallel' if path.startswith('parallel') else 'serial'}", path.endswith(
        "stream")


# ------------------------------------------------------------ forced paths
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("out_layout", ["BTHD", "BHTD"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gather_every_path_matches_reference(monkeypatch, force_path, dtype, layout,
                                             out_layout, path):
    # Odd sizes: rows of 5 elements (10 or 20 bytes) are never 16-byte
    # aligned, and the outputs start at odd addresses, so the streaming copy's
    # unaligned head and tail are exercised.
    rng = np.random.default_rng(1)
    page_size, num_heads, head_dim = 3, 3, 5
    store = KVStore(2, page_size, num_heads, head_dim, num_pages=40, dtype=dtype,
                    layout=layout, backend=REF)
    store.k[...] = random_bits(rng, store.shape, dtype)
    store.v[...] = random_bits(rng, store.shape, dtype)
    seq_lens = np.array([9, 1, 0, 7, 20], np.int32)
    table = np.full((5, 8), -1, np.int32)
    pages = rng.permutation(40)
    at = 0
    for b, n in enumerate(seq_lens):
        used = -(-n // page_size)
        table[b, :used] = pages[at:at + used]
        at += used
    num_positions = 23
    shape = ((5, num_positions, num_heads, head_dim) if out_layout == "BTHD"
             else (5, num_heads, num_positions, head_dim))
    item = store.dtype.itemsize
    out = (misaligned(shape, store.dtype, item, random_bits(rng, shape, dtype)),
           misaligned(shape, store.dtype, 3 * item, random_bits(rng, shape, dtype)))
    force_path(path)
    spy = Spy(monkeypatch)
    NUMBA.gather(store.k, store.v, 1, table, seq_lens, layout=layout, out_layout=out_layout,
                 out=out)
    want = REF.gather(store.k, store.v, 1, table, seq_lens, layout=layout,
                      out_layout=out_layout, num_positions=num_positions)
    assert_same_bits(out[0], want[0])
    assert_same_bits(out[1], want[1])
    name, stream = expected_kernel("gather", path)
    assert [c[0] for c in spy.calls] == [name]
    assert bool(spy.calls[0][1] & kernels.STREAM) == stream


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_write_every_path_matches_reference(monkeypatch, force_path, dtype, layout, path):
    rng = np.random.default_rng(2)
    page_size, num_heads, head_dim, num_pages = 4, 3, 5, 30
    stores = []
    for _ in range(2):
        stores.append(KVStore(2, page_size, num_heads, head_dim, num_pages=num_pages,
                              dtype=dtype, layout=layout, backend=REF))
    init = random_bits(rng, stores[0].shape, dtype), random_bits(rng, stores[0].shape, dtype)
    for s in stores:
        s.k[...], s.v[...] = init
    num_tokens = 50
    slots = rng.permutation(num_pages * page_size)[:num_tokens].astype(np.int32)
    slots[[3, 17, 40]] = -1
    k = random_bits(rng, (num_heads, num_tokens, head_dim), dtype).transpose(1, 0, 2)
    v = random_bits(rng, (num_tokens, num_heads, head_dim), dtype)
    force_path(path)
    spy = Spy(monkeypatch)
    NUMBA.write(stores[0].k, stores[0].v, 1, slots, k, v, layout=layout)
    REF.write(stores[1].k, stores[1].v, 1, slots, k, v, layout=layout)
    assert_same_bits(stores[0].k, stores[1].k)
    assert_same_bits(stores[0].v, stores[1].v)
    name, stream = expected_kernel("write", path)
    assert [c[0] for c in spy.calls] == [name]
    assert bool(spy.calls[0][1] & kernels.STREAM) == stream


@pytest.mark.parametrize("offset", [0, 2, 16])
@pytest.mark.parametrize("row_bytes", kernels._CONSTANT_RUNS)
@pytest.mark.parametrize("path", ["serial", "serial-stream", "parallel-stream"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_of_the_compiled_sizes_match_reference(monkeypatch, force_path, dtype, path,
                                                    row_bytes, offset):
    # Rows of 128, 256 and 512 bytes have copies of their own, streaming ones
    # with a fast path for 16-byte aligned destinations: outputs at offsets
    # 0 and 16 take it, at 2 bytes the general loop; float32 rows at an
    # offset of 2 bytes are not even element aligned.
    rng = np.random.default_rng(row_bytes + offset)
    head_dim = row_bytes // np.dtype(dtype).itemsize
    page_size, num_heads, num_pages = 4, 2, 12
    store = KVStore(1, page_size, num_heads, head_dim, num_pages=num_pages, dtype=dtype,
                    backend=REF)
    store.k[...] = random_bits(rng, store.shape, dtype)
    store.v[...] = random_bits(rng, store.shape, dtype)
    table = rng.permutation(num_pages).astype(np.int32).reshape(3, 4)
    seq_lens = np.array([16, 5, 11], np.int32)
    force_path(path)
    for out_layout in ("BHTD", "BTHD"):
        shape = (3, num_heads, 16, head_dim) if out_layout == "BHTD" else (3, 16, num_heads,
                                                                           head_dim)
        out = tuple(misaligned(shape, dtype, offset, random_bits(rng, shape, dtype))
                    for _ in range(2))
        NUMBA.gather(store.k, store.v, 0, table, seq_lens, out_layout=out_layout, out=out)
        want = REF.gather(store.k, store.v, 0, table, seq_lens, out_layout=out_layout)
        assert_same_bits(out[0], want[0])
        assert_same_bits(out[1], want[1])
    # writes of one head per token: runs of one row, into a store at an offset
    slots = rng.permutation(num_pages * page_size)[:9].astype(np.int32)
    k = random_bits(rng, (9, num_heads, head_dim), dtype)
    v = random_bits(rng, (9, num_heads, head_dim), dtype)[:, ::-1]
    targets = [misaligned(store.shape, dtype, offset, store.k) for _ in range(2)]
    NUMBA.write(targets[0], targets[1], 0, slots, k, v)
    want_k, want_v = store.k.copy(), store.k.copy()
    REF.write(want_k, want_v, 0, slots, k, v)
    assert_same_bits(targets[0], want_k)
    assert_same_bits(targets[1], want_v)


@pytest.mark.parametrize("path", list(PATHS))
def test_copy_pages_every_path_matches_reference(monkeypatch, force_path, path):
    rng = np.random.default_rng(3)
    stores = [KVStore(3, 5, 3, 5, num_pages=20, dtype="float16", backend=REF) for _ in range(2)]
    init = random_bits(rng, stores[0].shape, "float16"), random_bits(rng, stores[0].shape,
                                                                     "float16")
    for s in stores:
        s.k[...], s.v[...] = init
    order = rng.permutation(20).astype(np.int32)
    force_path(path)
    spy = Spy(monkeypatch)
    NUMBA.copy_pages(stores[0].k, stores[0].v, order[:7], order[7:14])
    REF.copy_pages(stores[1].k, stores[1].v, order[:7], order[7:14])
    assert_same_bits(stores[0].k, stores[1].k)
    assert_same_bits(stores[0].v, stores[1].v)
    assert [c[0] for c in spy.calls] == [expected_kernel("copy_pages", path)[0]]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_write_with_strided_head_dim(dtype, layout):
    """A k whose last axis is strided too (no run longer than an element)."""
    rng = np.random.default_rng(4)
    stores = [KVStore(1, 4, 2, 6, num_pages=4, dtype=dtype, layout=layout, backend=REF)
              for _ in range(2)]
    wide = random_bits(rng, (5, 2, 12), dtype)
    k, v = wide[:, :, ::2], wide[::-1, :, 1::2]
    assert k.strides[-1] != k.itemsize and v.strides[0] < 0
    slots = np.array([0, 5, -1, 9, 15], np.int32)
    NUMBA.write(stores[0].k, stores[0].v, 0, slots, k, v, layout=layout)
    REF.write(stores[1].k, stores[1].v, 0, slots, k, v, layout=layout)
    assert_same_bits(stores[0].k, stores[1].k)
    assert_same_bits(stores[0].v, stores[1].v)


def test_size_picks_the_kernel(monkeypatch):
    """Default thresholds: a decode-sized write runs serial, a prefill-sized
    one parallel, both with streaming stores; a small gather runs serial with
    ordinary stores, a large one parallel and streaming."""
    rng = np.random.default_rng(5)
    store = KVStore(1, 16, 8, 128, num_pages=256, dtype="float32", backend=REF)
    spy = Spy(monkeypatch)
    decode = random_bits(rng, (32, 8, 128), "float32")  # 256 KiB of K and V
    NUMBA.write(store.k, store.v, 0, np.arange(32, dtype=np.int32) * 16, decode, decode)
    prefill = random_bits(rng, (2048, 8, 128), "float32")  # 16 MiB
    NUMBA.write(store.k, store.v, 0, np.arange(2048, dtype=np.int32), prefill, prefill)
    table = np.arange(256, dtype=np.int32).reshape(4, 64)
    NUMBA.gather(store.k, store.v, 0, table, np.array([3, 1, 0, 2], np.int32))
    NUMBA.gather(store.k, store.v, 0, table, np.full(4, 1024, np.int32))  # 32 MiB
    big = "parallel" if numba.get_num_threads() >= numba_cpu.PARALLEL_MIN_THREADS else "serial"
    assert [(name, bool(flags & kernels.STREAM)) for name, flags in spy.calls] == [
        ("write_serial", True), (f"write_{big}", True),
        ("gather_serial", False), (f"gather_{big}", True)]
    assert 2 * decode.nbytes < numba_cpu.PARALLEL_MIN_BYTES <= numba_cpu.STREAM_MIN_BYTES


def test_one_thread_means_serial_kernels(monkeypatch):
    rng = np.random.default_rng(7)
    store = KVStore(1, 16, 8, 128, num_pages=160, dtype="float16", backend=REF)
    prefill = random_bits(rng, (2048, 8, 128), "float16")  # 8 MiB
    spy = Spy(monkeypatch)
    saved = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        NUMBA.write(store.k, store.v, 0, np.arange(2048, dtype=np.int32), prefill, prefill)
    finally:
        numba.set_num_threads(saved)
    assert [name for name, _ in spy.calls] == ["write_serial"]


def test_parallel_result_does_not_depend_on_thread_count(force_path):
    rng = np.random.default_rng(6)
    store = KVStore(1, 16, 4, 32, num_pages=64, dtype="bfloat16", layout="HND", backend=REF)
    store.k[...] = random_bits(rng, store.shape, "bfloat16")
    store.v[...] = random_bits(rng, store.shape, "bfloat16")
    table = rng.permutation(64).astype(np.int32).reshape(4, 16)
    seq_lens = np.array([256, 3, 100, 17], np.int32)
    force_path("parallel-stream")
    results = []
    saved = numba.get_num_threads()
    try:
        for threads in sorted({1, saved}):
            numba.set_num_threads(threads)
            results.append(NUMBA.gather(store.k, store.v, 0, table, seq_lens,
                                        layout="HND", out_layout="BHTD"))
    finally:
        numba.set_num_threads(saved)
    want = REF.gather(store.k, store.v, 0, table, seq_lens, layout="HND", out_layout="BHTD")
    for got in results:
        assert_same_bits(got[0], want[0])
        assert_same_bits(got[1], want[1])


# ------------------------------------------------------------------ warmup
def test_warmup_compiles_every_kernel():
    seconds = pk.warmup(dtypes=("bfloat16",), layouts=("HND",), out_layouts=("BHTD",))
    assert seconds >= 0
    for name in ("write_serial", "write_parallel", "gather_serial", "gather_parallel",
                 "copy_pages_serial", "copy_pages_parallel"):
        assert getattr(kernels, name).signatures, name
    # contiguous and strided k/v both compiled
    layouts = {sig[4].layout for sig in kernels.write_serial.signatures}
    assert {"C", "A"} <= layouts


def test_warmup_compiles_the_int8_kernels():
    from pagedkv_np.backends import _numba_quant as quant_kernels

    pk.warmup(dtypes=("int8",), layouts=("NHD",), out_layouts=("BTHD",))
    for name in ("write_q_serial", "write_q_parallel", "gather_q_serial", "gather_q_parallel"):
        assert getattr(quant_kernels, name).signatures, name
    # float32 values and 16-bit bits in, contiguous and strided
    inputs = {(sig[6].dtype.name, sig[6].layout)
              for sig in quant_kernels.write_q_serial.signatures}
    assert {("float32", "C"), ("float32", "A"), ("uint16", "C"), ("uint16", "A")} <= inputs
    outputs = {sig[7].dtype.name for sig in quant_kernels.gather_q_serial.signatures}
    assert {"float32", "uint16"} <= outputs


def test_warmup_rejects_unknown_names():
    with pytest.raises(DTypeError):
        pk.warmup(dtypes=("float64",))
    with pytest.raises(LayoutError):
        pk.warmup(layouts=("NDH",))
    with pytest.raises(LayoutError):
        pk.warmup(out_layouts=("BTDH",))


# ------------------------------------------------------ processes of their own
def run_python(code: str, env_update: dict[str, str | None], cwd: Path | None = None) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PAGEDKV_NUMBA_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    for key, value in env_update.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# Compile one small kernel through the backend and report where it was cached.
CACHE_PROBE = """
    import json, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import numpy as np
        import pagedkv_np as pk
        from pagedkv_np.backends import jit as _jit
        be = pk.get_backend("numba")
        st = pk.KVStore(1, 4, 2, 8, num_pages=4, backend=be)
        be.copy_pages(st.k, st.v, np.array([0], np.int32), np.array([1], np.int32))
    from pagedkv_np.backends import _numba_kernels as K
    stats = K.copy_pages_serial.stats
    print(json.dumps({
        "cache_dir": _jit.cache_dir(),
        "kernel_cache_path": stats.cache_path,
        "hits": sum(stats.cache_hits.values()),
        "misses": sum(stats.cache_misses.values()),
        "warnings": [str(w.message) for w in caught
                     if issubclass(w.category, RuntimeWarning) and "pagedkv_np" in str(w.message)],
    }))
"""


def probe(env_update: dict[str, str | None]) -> dict:
    return json.loads(run_python(CACHE_PROBE, env_update).strip().splitlines()[-1])


def index_files(path: Path) -> list[Path]:
    return sorted(path.rglob("*.nbi")) if path.exists() else []


def test_cache_dir_env_var_wins_and_warm_process_loads_from_it(tmp_path):
    ours, numbas = tmp_path / "ours", tmp_path / "numbas"
    env = {"PAGEDKV_NUMBA_CACHE_DIR": str(ours), "NUMBA_CACHE_DIR": str(numbas)}
    first = probe(env)
    assert first["cache_dir"] == str(ours)
    assert first["kernel_cache_path"].startswith(str(ours))
    assert first["misses"] >= 1 and not first["warnings"]
    assert index_files(ours) and not index_files(numbas)
    second = probe(env)
    assert second["hits"] >= 1 and second["misses"] == 0


def test_user_numba_cache_dir_is_respected(tmp_path):
    numbas = tmp_path / "numbas"
    result = probe({"NUMBA_CACHE_DIR": str(numbas)})
    assert result["cache_dir"] == str(numbas)
    assert index_files(numbas)


def test_default_cache_dir_is_under_xdg_cache_home(tmp_path):
    result = probe({"XDG_CACHE_HOME": str(tmp_path)})
    expected = tmp_path / "pagedkv_np" / "numba"
    assert result["cache_dir"] == str(expected)
    assert index_files(expected)


@pytest.mark.parametrize("how", ["env var", "home"])
def test_unwritable_cache_dir_warns_once_and_works(tmp_path, how):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    if how == "env var":
        env = {"PAGEDKV_NUMBA_CACHE_DIR": str(blocker / "cache")}
    else:
        env = {"HOME": str(blocker), "XDG_CACHE_HOME": None}
    result = probe(env)
    assert result["cache_dir"] is None
    assert result["kernel_cache_path"] is None  # no disk cache at all
    assert len(result["warnings"]) == 1 and "not writable" in result["warnings"][0]
    assert blocker.read_text() == "not a directory"


def test_without_numba_the_package_and_numpy_backend_work():
    out = run_python("""
        import sys
        sys.modules["numba"] = None  # makes `import numba` raise ImportError
        import numpy as np
        import pagedkv_np as pk
        from pagedkv_np.backends import default_backend_name
        be = pk.get_backend("numpy")
        st = pk.KVStore(1, 4, 2, 8, num_pages=4, backend=be)
        ones = np.ones((2, 2, 8), np.float32)
        be.write(st.k, st.v, 0, np.array([1, 6], np.int32), ones, ones)
        k, _ = be.gather(st.k, st.v, 0, np.array([[0, 1]], np.int32), np.array([7], np.int32))
        assert k[0, 1].sum() == 16 and k[0, 6].sum() == 16 and k[0, 0].sum() == 0
        try:
            pk.get_backend("numba")
        except pk.BackendUnavailable as exc:
            print("UNAVAILABLE:", exc)
        try:
            pk.warmup()
        except pk.BackendUnavailable:
            print("WARMUP UNAVAILABLE")
        print("DEFAULT:", default_backend_name())
        print("AVAILABLE:", "numba" in pk.available_backends())
    """, {})
    assert "UNAVAILABLE: backend 'numba' is unavailable: the numba backend needs Numba" in out
    assert "pip install" in out
    assert "WARMUP UNAVAILABLE" in out
    assert "DEFAULT: numpy" in out
    assert "AVAILABLE: False" in out


def test_disable_jit_makes_the_backend_unavailable():
    out = run_python("""
        import pagedkv_np as pk
        try:
            pk.get_backend("numba")
        except pk.BackendUnavailable as exc:
            print("UNAVAILABLE:", exc)
    """, {"NUMBA_DISABLE_JIT": "1"})
    assert "UNAVAILABLE:" in out and "NUMBA_DISABLE_JIT" in out


def test_boundscheck_catches_runs_outside_the_store(tmp_path):
    """With NUMBA_BOUNDSCHECK=1 the kernels check each run of bytes, serial and
    parallel alike (called directly here: the backend would reject the slot)."""
    out = run_python("""
        import numpy as np
        from pagedkv_np.backends import _numba_kernels as K
        store = np.zeros((1, 2, 4, 2, 8), np.uint8)
        k = np.ones((2, 2, 8), np.uint8)
        bad_slots = np.array([0, 8], np.int32)  # slot 8 is past the last page
        for kernel in (K.write_serial, K.write_parallel):
            try:
                kernel(store, store.copy(), 0, bad_slots, k, k, 0)
            except IndexError as exc:
                print("RAISED", kernel.__name__, exc)
    """, {"NUMBA_BOUNDSCHECK": "1", "PAGEDKV_NUMBA_CACHE_DIR": str(tmp_path)})
    assert "RAISED write_serial" in out and "RAISED write_parallel" in out
    assert index_files(tmp_path / "boundscheck")  # kept apart from unchecked code
