"""Tests of the CuPy backend and its CUDA kernels.

Most of this file needs no GPU:

* the kernel sources compile with nvcc (sm_80, sm_90, warnings as errors) and
  with NVRTC as the backend compiles them;
* the kernel sources themselves run on the CPU: they are compiled as plain
  C++ with a few lines standing in for CUDA's built-ins, every thread of every
  block run in turn, with the launch plans the backend computes, and compared
  bit for bit to the NumPy reference (the kernels share nothing between
  threads, so running threads one after another gives what a GPU gives);
* the wheel ships the sources and the installed package finds them;
* without a GPU, ``get_backend("cupy")`` says why.

The tests that launch kernels on a GPU skip when CuPy sees none.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest

from pagedkv_np import (
    BackendUnavailable, DTypeError, ShapeError, available_backends, get_backend)
from pagedkv_np.backends import _cuda_sources
from pagedkv_np.backends.cupy_gpu import (
    CupyBackend, block_shape, plan_copy_pages, plan_gather, plan_gather_quantized, plan_write,
    plan_write_quantized, row_strides, word_bytes)
from pagedkv_np.backends.numpy_ref import NumpyBackend
from pagedkv_np.layout import OutputLayout, StoreLayout, bits_view_dtype, resolve_dtype
from pagedkv_np.quant import group_size

REPO = Path(__file__).resolve().parent.parent
KERNELS = REPO / "kernels"
IN_CI = os.environ.get("CI") == "true"

DTYPES = ["float32", "float16", "bfloat16"]
LAYOUTS = [StoreLayout.NHD, StoreLayout.HND]
PAGE_SIZES = [1, 16, 128]


def _tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/local/cuda/bin/{name}"
                                  if Path(f"/usr/local/cuda/bin/{name}").exists() else None)
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is required in CI")
        pytest.skip(f"{name} not found")
    return path


def bits(x: np.ndarray) -> np.ndarray:
    return x.view(bits_view_dtype(x.dtype))


# ---------------------------------------------------------------- test data
def random_bits(shape, dtype, rng) -> np.ndarray:
    """Random bit patterns (NaN payloads and signed zeros included)."""
    dtype = resolve_dtype(dtype)
    raw = rng.integers(0, 2 ** (8 * dtype.itemsize), size=shape, dtype=np.uint64)
    return raw.astype(bits_view_dtype(dtype)).view(dtype)


class Case:
    """A store with random contents and a batch of four sequences: empty,
    exactly one page, one token past two pages, one token short of three;
    the page table is padded with -1 past each sequence's pages."""

    def __init__(self, dtype, layout, page_size, head_dim=64, num_kv_heads=2, seed=0):
        rng = np.random.default_rng(seed)
        self.layout, self.page_size = layout, page_size
        self.seq_lens = np.array([0, page_size, 2 * page_size + 1, 3 * page_size - 1],
                                 dtype=np.int32)
        pages_used = -(-self.seq_lens // page_size)
        max_pages = int(pages_used.max()) + 1
        num_pages = int(pages_used.sum()) + 6
        order = rng.permutation(num_pages).astype(np.int32)
        self.page_table = np.full((4, max_pages), -1, dtype=np.int32)
        at = 0
        for b, n in enumerate(pages_used):
            self.page_table[b, :n] = order[at:at + n]
            at += n
        self.free_pages = order[at:]
        shape = ((2, num_pages, page_size, num_kv_heads, head_dim) if layout is StoreLayout.NHD
                 else (2, num_pages, num_kv_heads, page_size, head_dim))
        self.k_cache = random_bits(shape, dtype, rng)
        self.v_cache = random_bits(shape, dtype, rng)
        # Every token of every sequence, a -1 before each sequence.
        slots = []
        for b, n in enumerate(self.seq_lens):
            slots.append(-1)
            t = np.arange(n)
            slots.extend(self.page_table[b, t // page_size] * page_size + t % page_size)
        self.slot_mapping = np.array(slots, dtype=np.int32)
        n = len(slots)
        self.k = random_bits((n, num_kv_heads, head_dim), dtype, rng)
        self.v = random_bits((n, num_kv_heads, head_dim), dtype, rng)
        self.num_positions = int(self.seq_lens.max()) + 3
        self.src_pages = self.page_table[2, :3].copy()
        self.dst_pages = self.free_pages[:3].copy()


# ------------------------------------------------- kernel launch plans (host)
def test_word_bytes_is_the_widest_that_divides_everything():
    assert word_bytes(2, 128, (0, 256), (512, 1024)) == 16
    assert word_bytes(2, 8) == 8                       # head_dim 4, float16
    assert word_bytes(2, 6) == 2                       # head_dim 3, float16
    assert word_bytes(4, 12) == 4                      # head_dim 3, float32
    assert word_bytes(4, 256, (4,)) == 4               # one misaligned address
    assert word_bytes(2, 256, (0,), (-32,)) == 16      # negative strides count too
    assert word_bytes(2, 256, (0,), (2,)) == 2


@pytest.mark.parametrize("row_words, num_heads, want", [
    (16, 8, (16, 8, 2)), (1, 1, (1, 1, 64)), (2, 1, (2, 1, 64)), (100, 3, (32, 4, 2)),
    (8, 64, (8, 32, 1)), (1, 300, (1, 256, 1))])
def test_block_shape_respects_cuda_limits(row_words, num_heads, want):
    assert block_shape(row_words, num_heads) == want
    check_launch_limits(want, (1, 1, 1))


def check_launch_limits(block, grid):
    """What a GPU refuses to launch: the kernels' __launch_bounds__(256) and
    CUDA's limits per axis."""
    assert np.prod(block) <= 256 and block[2] <= 64
    assert 1 <= grid[0] <= 2**31 - 1 and 1 <= grid[1] <= 65535 and 1 <= grid[2] <= 65535


def test_plans_for_empty_work_are_none():
    shape = (1, 4, 16, 2, 8)
    assert plan_write(StoreLayout.NHD, shape, 2, 0, (0,) * 4, (0, 0), (0, 0)) is None
    assert plan_gather(StoreLayout.NHD, OutputLayout.BTHD, shape, 2, 3, 1, 0, (0,) * 4) is None
    assert plan_copy_pages(shape, 2, 0, (0, 0)) is None


# ------------------------------------------------------------ compile checks
@pytest.mark.parametrize("arch", ["80", "90"])
@pytest.mark.parametrize("file_name", _cuda_sources.KERNEL_FILES)
def test_nvcc_compiles_without_warnings(file_name, arch, tmp_path):
    nvcc = _tool("nvcc")
    proc = subprocess.run(
        [nvcc, "-std=c++17", f"-arch=sm_{arch}", "-cubin", "-Werror", "all-warnings",
         f"-I{KERNELS}", "-o", str(tmp_path / "k.cubin"), str(KERNELS / file_name)],
        capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "k.cubin").stat().st_size > 0


def test_every_source_is_listed():
    assert sorted(p.name for p in KERNELS.glob("*.cu")) == sorted(_cuda_sources.KERNEL_FILES)


def test_nvrtc_compiles_as_the_backend_does():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import check_nvrtc
    finally:
        sys.path.pop(0)
    try:
        check_nvrtc.load_nvrtc()
    except check_nvrtc.NvrtcNotFound as exc:
        pytest.skip(str(exc))
    assert check_nvrtc.main(["--arch", "80", "--arch", "90"]) == 0


def test_compile_errors_name_file_and_line():
    log = ('paged_write.cu(31): error: identifier "y" is undefined\n    x = y;\n\n'
           '1 error detected in the compilation of "paged_write.cu".\n')
    message = _cuda_sources.format_compile_error("paged_write.cu", log)
    assert message.startswith("the CUDA kernel source paged_write.cu failed to compile")
    assert 'paged_write.cu(31): error: identifier "y" is undefined' in message.splitlines()[0]


def test_module_source_names_the_file_for_compiler_messages():
    text = _cuda_sources.module_source("paged_gather.cu")
    first, second = text.splitlines()[:2]
    assert "pagedkv_common.cuh sha256" in first
    assert second == '#line 1 "paged_gather.cu"'
    assert text.endswith(_cuda_sources.read_source("paged_gather.cu"))


# ---------------------------------------------- the kernels, run on the CPU
_EMULATION = r"""
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <utility>
static inline float __uint_as_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
static inline uint32_t __float_as_uint(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }
struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#include "paged_write.cu"
#include "paged_gather.cu"
#include "copy_pages.cu"
#include "paged_quant.cu"

template <class... A, std::size_t... I>
static void emu_run(void (*kernel)(A...), const unsigned* d, void** argv,
                    std::index_sequence<I...>) {
    gridDim = {d[0], d[1], d[2]};
    blockDim = {d[3], d[4], d[5]};
    for (unsigned bz = 0; bz < d[2]; ++bz) for (unsigned by = 0; by < d[1]; ++by)
    for (unsigned bx = 0; bx < d[0]; ++bx) for (unsigned tz = 0; tz < d[5]; ++tz)
    for (unsigned ty = 0; ty < d[4]; ++ty) for (unsigned tx = 0; tx < d[3]; ++tx) {
        blockIdx = {bx, by, bz};
        threadIdx = {tx, ty, tz};
        kernel(*static_cast<A*>(argv[I])...);
    }
}
template <class... A>
static void emu(void (*kernel)(A...), const unsigned* d, void** argv) {
    emu_run(kernel, d, argv, std::index_sequence_for<A...>{});
}
#define EMU(NAME) extern "C" void emu_##NAME(const unsigned* d, void** argv) { emu(NAME, d, argv); }
#define EMU_ALL(STEM) EMU(STEM##_b2) EMU(STEM##_b4) EMU(STEM##_b8) EMU(STEM##_b16)
EMU_ALL(paged_write)
EMU_ALL(paged_gather)
EMU_ALL(copy_pages)
EMU(copy_pages_b1)
EMU(paged_write_q_f32) EMU(paged_write_q_f16) EMU(paged_write_q_bf16)
EMU(paged_gather_q_f32) EMU(paged_gather_q_f16) EMU(paged_gather_q_bf16)
"""


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    """The kernel sources compiled for the CPU: ``run(plan, arrays, grid=None)``."""
    cxx = _tool("g++")
    folder = tmp_path_factory.mktemp("emu")
    (folder / "emu.cpp").write_text(_EMULATION)
    lib_path = folder / "emu.so"
    proc = subprocess.run(
        [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-Wall", "-Werror", f"-I{KERNELS}",
         "-o", str(lib_path), str(folder / "emu.cpp")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lib = ctypes.CDLL(str(lib_path))

    def launch(entry_point, grid, block, args):
        """As a CuPy kernel call: arrays become pointers, NumPy scalars keep their width."""
        check_launch_limits(block, grid)
        values = [(ctypes.c_int32 if a.dtype == np.int32 else ctypes.c_int64)(int(a))
                  if isinstance(a, np.generic) else ctypes.c_void_p(a.ctypes.data)
                  for a in args]
        argv = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        getattr(lib, "emu_" + entry_point)((ctypes.c_uint * 6)(*grid, *block), argv)

    def run(plan, arrays, grid=None):
        check_launch_limits(plan.block, plan.grid)
        launch(plan.entry_point, plan.grid if grid is None else grid, plan.block,
               (*arrays, *plan.scalars))

    run.launch = launch
    return run


def emu_write(run, case, k, v, grid=None):
    k_cache, v_cache = case.k_cache.copy(), case.v_cache.copy()
    k_layer, v_layer = k_cache[1], v_cache[1]
    plan = plan_write(case.layout, k_cache.shape, k_cache.itemsize, len(case.slot_mapping),
                      (k_layer.ctypes.data, v_layer.ctypes.data, k.ctypes.data, v.ctypes.data),
                      row_strides(k.shape, k.strides), row_strides(v.shape, v.strides))
    run(plan, (k_layer, v_layer, k, v, case.slot_mapping), grid)
    return k_cache, v_cache, plan


def emu_gather(run, case, out_layout, out=None, grid=None):
    h, d = case.k.shape[1:]
    t = case.num_positions
    shape = (4, t, h, d) if out_layout is OutputLayout.BTHD else (4, h, t, d)
    # Random contents: every element must be written, zeros included.
    k_out, v_out = out or (random_bits(shape, case.k.dtype, np.random.default_rng(1)),
                           random_bits(shape, case.k.dtype, np.random.default_rng(2)))
    k_layer, v_layer = case.k_cache[1], case.v_cache[1]
    plan = plan_gather(case.layout, out_layout, case.k_cache.shape, case.k_cache.itemsize,
                       4, case.page_table.shape[1], t,
                       (k_layer.ctypes.data, v_layer.ctypes.data, k_out.ctypes.data,
                        v_out.ctypes.data))
    run(plan, (k_layer, v_layer, k_out, v_out, case.page_table, case.seq_lens), grid)
    return k_out, v_out, plan


def ref_write(case, k, v):
    k_cache, v_cache = case.k_cache.copy(), case.v_cache.copy()
    NumpyBackend().write(k_cache, v_cache, 1, case.slot_mapping, k, v, layout=case.layout)
    return k_cache, v_cache


def ref_gather(case, out_layout):
    return NumpyBackend().gather(case.k_cache, case.v_cache, 1, case.page_table, case.seq_lens,
                                 layout=case.layout, out_layout=out_layout,
                                 num_positions=case.num_positions)


def assert_same_bits(got, want):
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_array_equal(bits(g), bits(w))


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_kernels_match_reference(emulator, dtype, layout, page_size):
    case = Case(dtype, layout, page_size)
    k_cache, v_cache, plan = emu_write(emulator, case, case.k, case.v)
    assert plan.entry_point == "paged_write_b16"
    assert_same_bits((k_cache, v_cache), ref_write(case, case.k, case.v))
    for out_layout in OutputLayout:
        k_out, v_out, plan = emu_gather(emulator, case, out_layout)
        assert plan.entry_point == "paged_gather_b16"
        assert_same_bits((k_out, v_out), ref_gather(case, out_layout))
    k_cache, v_cache = case.k_cache.copy(), case.v_cache.copy()
    plan = plan_copy_pages(k_cache.shape, k_cache.itemsize, 3,
                           (k_cache.ctypes.data, v_cache.ctypes.data))
    emulator(plan, (k_cache, v_cache, case.src_pages, case.dst_pages))
    want_k, want_v = case.k_cache.copy(), case.v_cache.copy()
    NumpyBackend().copy_pages(want_k, want_v, case.src_pages, case.dst_pages, layout=layout)
    assert_same_bits((k_cache, v_cache), (want_k, want_v))


@pytest.mark.parametrize("dtype, head_dim, num_kv_heads, word", [
    ("float16", 4, 3, 8), ("bfloat16", 2, 3, 4), ("float16", 3, 3, 2), ("float32", 3, 3, 4),
    ("float32", 2, 3, 8), ("float16", 8, 1, 16), ("float32", 1, 1, 4), ("float32", 256, 5, 16)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_other_rows_match_reference(emulator, dtype, head_dim, num_kv_heads, word,
                                              layout):
    """Rows too short for 16-byte words, one word per row (blocks of 64
    tokens), and rows wider than a warp of words."""
    case = Case(dtype, layout, 16, head_dim=head_dim, num_kv_heads=num_kv_heads)
    k_cache, v_cache, plan = emu_write(emulator, case, case.k, case.v)
    assert plan.entry_point == f"paged_write_b{word}"
    assert_same_bits((k_cache, v_cache), ref_write(case, case.k, case.v))
    for out_layout in OutputLayout:
        k_out, v_out, plan = emu_gather(emulator, case, out_layout)
        assert plan.entry_point == f"paged_gather_b{word}"
        assert_same_bits((k_out, v_out), ref_gather(case, out_layout))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_emulated_strided_inputs_and_small_grids(emulator, layout):
    """Any token/head strides of k and v (here head-major and reversed), an
    output one element off alignment, and grids smaller than the work (every
    loop is grid-stride) give the reference's bits."""
    case = Case("float16", layout, 16)
    k_hmajor = np.ascontiguousarray(case.k.transpose(1, 0, 2)).transpose(1, 0, 2)
    v_reversed = np.ascontiguousarray(case.v[::-1])[::-1]
    want = ref_write(case, case.k, case.v)
    for grid in (None, (1, 1, 1), (2, 1, 1)):
        k_cache, v_cache, plan = emu_write(emulator, case, k_hmajor, v_reversed, grid)
        assert plan.entry_point == "paged_write_b16"
        assert_same_bits((k_cache, v_cache), want)
    h, d = case.k.shape[1:]
    shape = (4, h, case.num_positions, d)
    flat = [np.zeros(int(np.prod(shape)) + 1, dtype=case.k.dtype) for _ in range(2)]
    out = tuple(f[1:].reshape(shape) for f in flat)  # 2 bytes past a 16-byte boundary
    want = ref_gather(case, OutputLayout.BHTD)
    for grid in (None, (1, 1, 1), (3, 2, 1)):
        k_out, v_out, plan = emu_gather(emulator, case, OutputLayout.BHTD, out, grid)
        assert plan.entry_point == "paged_gather_b2"
        assert_same_bits((k_out, v_out), want)
    k_cache, v_cache = case.k_cache.copy(), case.v_cache.copy()
    plan = plan_copy_pages(k_cache.shape, 2, 3, (k_cache.ctypes.data, v_cache.ctypes.data))
    emulator(plan, (k_cache, v_cache, case.src_pages, case.dst_pages), grid=(1, 1, 1))
    want_k, want_v = case.k_cache.copy(), case.v_cache.copy()
    NumpyBackend().copy_pages(want_k, want_v, case.src_pages, case.dst_pages, layout=layout)
    assert_same_bits((k_cache, v_cache), (want_k, want_v))


class FakeDevice(contextlib.nullcontext):
    """GPU 0, as a CuPy Device: an id, and a context that makes it current."""

    id = 0


class FakeDeviceArray(np.ndarray):
    """Host memory posing as a CuPy array, so that the backend's own code (its
    checks, word choice and launches) runs here, with the kernels on the CPU."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    @property
    def device(self):
        return FakeDevice()

    def get(self):
        return np.array(self.view(np.ndarray))


@pytest.fixture
def emulated_backend(emulator, monkeypatch):
    """A CupyBackend whose CuPy is FakeDeviceArray and whose kernels run on the CPU."""
    from pagedkv_np.backends import cupy_gpu

    def device(x):
        return x if isinstance(x, FakeDeviceArray) else np.array(x).view(FakeDeviceArray)

    fake_cupy = types.SimpleNamespace(
        ndarray=FakeDeviceArray, asarray=device,
        ascontiguousarray=lambda x: np.ascontiguousarray(x).view(FakeDeviceArray),
        zeros=lambda shape, dtype: np.zeros(shape, dtype).view(FakeDeviceArray),
        # uninitialised memory: garbage bits that the kernels must overwrite
        empty=lambda shape, dtype: np.full(
            int(np.prod(shape)) * np.dtype(dtype).itemsize, 0xAB, np.uint8
        ).view(dtype).reshape(shape).view(FakeDeviceArray),
        may_share_memory=np.may_share_memory,
        cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0)))
    monkeypatch.setattr(cupy_gpu, "cupy", fake_cupy)
    monkeypatch.setattr(cupy_gpu, "get_kernel", lambda file_name, entry_point: (
        lambda grid, block, args: emulator.launch(entry_point, grid, block, args)))
    backend = object.__new__(CupyBackend)
    backend.array_types = (FakeDeviceArray,)
    return backend


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_backend_public_calls_match_reference(emulated_backend, dtype, layout):
    be, case = emulated_backend, Case(dtype, layout, 16)
    dev = FakeDeviceArray
    k_hmajor = np.ascontiguousarray(case.k.transpose(1, 0, 2)).transpose(1, 0, 2).view(dev)
    k_spaced = np.repeat(case.k, 2, axis=2)[..., ::2].view(dev)  # rows with a stride
    v_reversed = np.ascontiguousarray(case.v[::-1])[::-1].view(dev)
    want = ref_write(case, case.k, case.v)
    for k, v in ((be.asarray(case.k), be.asarray(case.v)), (k_hmajor, v_reversed),
                 (k_spaced, case.v)):
        k_cache, v_cache = be.asarray(case.k_cache), be.asarray(case.v_cache)
        be.write(k_cache, v_cache, 1, case.slot_mapping, k, v, layout=layout)
        assert_same_bits((be.to_numpy(k_cache), be.to_numpy(v_cache)), want)
    k_cache, v_cache = be.asarray(case.k_cache), be.asarray(case.v_cache)
    for out_layout in OutputLayout:
        want = ref_gather(case, out_layout)
        got = be.gather(k_cache, v_cache, 1, case.page_table, case.seq_lens, layout=layout,
                        out_layout=out_layout, num_positions=case.num_positions)
        assert all(isinstance(x, dev) for x in got)
        assert_same_bits([be.to_numpy(x) for x in got], want)
        flat = [random_bits(want[0].size + 1, dtype, np.random.default_rng(i)) for i in (5, 6)]
        out = tuple(f[1:].reshape(want[0].shape).view(dev) for f in flat)
        got = be.gather(k_cache, v_cache, 1, case.page_table, case.seq_lens, layout=layout,
                        out_layout=out_layout, out=out)
        assert got[0] is out[0] and got[1] is out[1]
        assert_same_bits([be.to_numpy(x) for x in got], want)
    be.copy_pages(k_cache, v_cache, case.src_pages, case.dst_pages, layout=layout)
    want_k, want_v = case.k_cache.copy(), case.v_cache.copy()
    NumpyBackend().copy_pages(want_k, want_v, case.src_pages, case.dst_pages, layout=layout)
    assert_same_bits((be.to_numpy(k_cache), be.to_numpy(v_cache)), (want_k, want_v))


def test_emulated_backend_refuses_host_and_overlapping_outputs(emulated_backend):
    be, case = emulated_backend, Case("float16", StoreLayout.NHD, 16)
    k_cache, v_cache = be.asarray(case.k_cache), be.asarray(case.v_cache)
    shape = (4, case.num_positions, 2, 64)
    with pytest.raises(DTypeError, match=r"Invalid out\[0\]: expected a device array"):
        be.gather(k_cache, v_cache, 1, case.page_table, case.seq_lens,
                  out=(np.zeros(shape, np.float16), be.zeros(shape, np.float16)))
    both = be.zeros((2 * shape[0] - 1, *shape[1:]), np.float16)
    with pytest.raises(ShapeError, match="share memory"):
        be.gather(k_cache, v_cache, 1, case.page_table, case.seq_lens,
                  out=(both[:shape[0]], both[shape[0] - 1:]))


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_emulated_backend_through_the_cache(emulated_backend, monkeypatch, dtype):
    """A PagedKVCache on the CuPy backend takes host K/V (onnxruntime's), its
    plan's indices go up once per plan, and it gathers what the NumPy
    reference cache gathers, bit for bit."""
    from pagedkv_np import PagedKVCache
    from pagedkv_np.backends import cupy_gpu

    uploads = []
    device = cupy_gpu.cupy.asarray

    def counted(x):
        if isinstance(x, np.ndarray) and x.dtype == np.int32:
            uploads.append(x.shape)
        return device(x)

    monkeypatch.setattr(cupy_gpu.cupy, "asarray", counted)
    num_layers, heads, head_dim = 3, 2, 64
    rng = np.random.default_rng(3)
    caches = [PagedKVCache(num_layers, 12, 16, heads, head_dim, dtype=dtype, backend=be,
                           layout="HND") for be in (emulated_backend, "numpy")]
    prompt = rng.integers(0, 1000, 40)
    got = []
    for cache in caches:
        seq = cache.add_sequence(prompt)
        cache.extend(seq, prompt)
        plan = cache.plan([seq])
        data = np.random.default_rng(4)
        uploads.clear()
        for layer in range(num_layers):
            k, v = (data.standard_normal((40, heads, head_dim)).astype(
                np.float32 if dtype == "int8" else dtype) for _ in range(2))
            cache.write(layer, plan, k, v)   # host arrays, as onnxruntime returns
        got.append([cache.backend.to_numpy(x) for layer in range(num_layers)
                    for x in cache.gather(layer, plan)])
        if cache.backend is emulated_backend:
            assert all(isinstance(x, FakeDeviceArray) for x in cache.gather(0, plan))
            # slot_mapping once for the writes; page_table and seq_lens once for the gathers
            assert sorted(uploads) == sorted([(40,), (1, 3), (1,)])
    assert_same_bits(got[0], got[1])


@pytest.mark.parametrize("family", ["optimum", "gqa"])
def test_emulated_backend_serves_an_ort_decoder(emulated_backend, family):
    """OrtDecoder on the CuPy backend: onnxruntime's host K/V go up to the
    pages, gathered pasts come back down, and greedy tokens equal those of
    the same engine on the NumPy backend and of a full recompute."""
    import onnxruntime as ort
    from pagedkv_np.onnxruntime import OrtDecoder
    from pagedkv_np.models.testmodel import DecoderConfig, build_model

    from helpers import full_recompute_logits

    config = DecoderConfig()
    model = build_model(config, family=family).SerializeToString()
    rng = np.random.default_rng(5)
    system = rng.integers(0, config.vocab_size, 20).tolist()
    prompts = [system + rng.integers(0, config.vocab_size, n).tolist() for n in (3, 9, 0)]
    outs = {}
    for name, backend in (("cupy", emulated_backend), ("numpy", "numpy")):
        dec = OrtDecoder(model, num_pages=64, page_size=8, max_batch_size=2, backend=backend)
        outs[name] = dec.generate(prompts, max_new_tokens=12)
        if name == "cupy":
            assert isinstance(dec.cache.k_cache, FakeDeviceArray)
            assert dec.stats["prefix_hit_tokens"] >= 16   # the shared pages were gathered
    assert outs["cupy"] == outs["numpy"]
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    tokens = list(prompts[1])
    for want in outs["cupy"][1]:
        assert int(np.argmax(full_recompute_logits(sess, tokens))) == want
        tokens.append(want)


# ------------------------------------------------- int8 stores, on the CPU
class QCase(Case):
    """:class:`Case` with an int8 store (random codes, scales over the whole
    float32 range, zeros among them) and K/V values with every edge of the
    format: NaN, infinities, subnormals, zero heads, tiny heads."""

    def __init__(self, dtype, layout, page_size, head_dim=64, num_kv_heads=2, seed=0):
        super().__init__("float32", layout, page_size, head_dim, num_kv_heads, seed)
        rng = np.random.default_rng(seed + 1)
        shape = self.k_cache.shape
        self.k_cache = rng.integers(-127, 128, shape).astype(np.int8)
        self.v_cache = rng.integers(-127, 128, shape).astype(np.int8)
        scale_shape = (*shape[:4], head_dim // group_size(head_dim))
        self.k_scale, self.v_scale = (
            np.where(rng.random(scale_shape) < 0.05, 0,
                     2.0 ** rng.uniform(-126, 100, scale_shape)).astype(np.float32)
            for _ in range(2))
        n = len(self.slot_mapping)
        values = []
        for _ in range(2):
            x = rng.standard_normal((n, num_kv_heads, head_dim)) * 10.0 ** rng.uniform(
                -3, 3, (n, num_kv_heads, 1))
            edges = [np.nan, np.inf, -np.inf, 1e-40, -1e-39, 0.0][:head_dim]
            x[1, 0, :len(edges)] = edges
            x[2] = 0
            x[3, 0] = 1e-37
            with np.errstate(over="ignore", invalid="ignore"):
                values.append(x.astype(np.float32).astype(resolve_dtype(dtype)))
        self.k, self.v = values
        self.dtype = resolve_dtype(dtype)

    def stores(self, wrap=lambda x: x.copy()):
        return tuple(wrap(x) for x in (self.k_cache, self.v_cache, self.k_scale, self.v_scale))


@pytest.mark.parametrize("head_dim", [64, 8, 3])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_quantized_kernels_match_reference(emulated_backend, dtype, layout, page_size,
                                                    head_dim):
    be, dev = emulated_backend, FakeDeviceArray
    case = QCase(dtype, layout, page_size, head_dim=head_dim)
    ref = NumpyBackend()
    want = case.stores()
    ref.write_quantized(*want, 1, case.slot_mapping, case.k, case.v, layout=layout)
    k_hmajor = np.ascontiguousarray(case.k.transpose(1, 0, 2)).transpose(1, 0, 2).view(dev)
    for k, v in ((be.asarray(case.k), be.asarray(case.v)), (k_hmajor, case.v)):
        got = case.stores(be.asarray)
        be.write_quantized(*got, 1, case.slot_mapping, k, v, layout=layout)
        assert_same_bits([be.to_numpy(x) for x in got], want)
    stores = case.stores(be.asarray)
    for out_layout in OutputLayout:
        for out_dtype in DTYPES:
            want = ref.gather_quantized(*case.stores(), 1, case.page_table, case.seq_lens,
                                        layout=layout, out_layout=out_layout,
                                        num_positions=case.num_positions, dtype=out_dtype)
            out = tuple(random_bits(want[0].shape, out_dtype, np.random.default_rng(i))
                        .view(dev) for i in (7, 8))
            got = be.gather_quantized(*stores, 1, case.page_table, case.seq_lens,
                                      layout=layout, out_layout=out_layout, out=out)
            assert got[0] is out[0]
            assert_same_bits([be.to_numpy(x) for x in got], want)
    # an int8 store's pages (odd sizes take one-byte words) and their scales
    be.copy_pages(stores[0], stores[1], case.src_pages, case.dst_pages, layout=layout)
    be.copy_pages(stores[2], stores[3], case.src_pages, case.dst_pages, layout=layout)
    want = case.stores()
    ref.copy_pages(want[0], want[1], case.src_pages, case.dst_pages, layout=layout)
    ref.copy_pages(want[2], want[3], case.src_pages, case.dst_pages, layout=layout)
    assert_same_bits([be.to_numpy(x) for x in stores], want)


def test_quantized_plans():
    shape = (2, 10, 16, 8, 128)
    plan = plan_write_quantized(StoreLayout.HND, (2, 10, 8, 16, 128), np.dtype(np.float16), 5,
                                32, (2048, 256), (2048, 256))
    assert plan.entry_point == "paged_write_q_f16" and plan.file_name == "paged_quant.cu"
    assert plan.grid == (1, 1, 1) and plan.block == (256, 1, 1)
    # page, offset and head strides in rows of an HND store; k/v strides in elements
    assert [int(x) for x in plan.scalars[5:]] == [128, 1, 16, 1024, 128, 1024, 128]
    plan = plan_gather_quantized(StoreLayout.NHD, OutputLayout.BHTD, shape,
                                 resolve_dtype("bfloat16"), 3, 4, 50, 32)
    assert plan.entry_point == "paged_gather_q_bf16"
    assert plan.grid == (-(-3 * 50 * 8 * 128 // 256), 1, 1)
    assert [int(x) for x in plan.scalars[7:]] == [1, 128, 8, 1]
    assert plan_write_quantized(StoreLayout.NHD, shape, np.float32, 0, 32, (0, 0),
                                (0, 0)) is None
    assert plan_gather_quantized(StoreLayout.NHD, OutputLayout.BTHD, shape, np.float32, 0, 4,
                                 50, 32) is None


# ------------------------------------------------------------------ packaging
def test_wheel_ships_the_sources_and_the_installed_loader_finds_them(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("pagedkv_np-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    shipped = sorted(p.name for p in (site / "pagedkv_np" / "_kernels").iterdir())
    assert shipped == sorted([*_cuda_sources.KERNEL_FILES, _cuda_sources.COMMON_HEADER])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = ("import pagedkv_np.backends._cuda_sources as s\n"
              "print(s.kernel_dir())\n"
              "for f in s.KERNEL_FILES: assert 'extern \"C\"' in s.module_source(f)\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip()) == (site / "pagedkv_np" / "_kernels").resolve()


def test_source_checkout_uses_top_level_kernels():
    assert _cuda_sources.kernel_dir() == KERNELS.resolve()


# ------------------------------------------------------------- availability
def _gpu_available() -> bool:
    return CupyBackend.availability() is None


def test_get_backend_says_why_it_is_unavailable():
    """Without CuPy or a GPU (the state of CPU machines), asking for the backend
    raises with the reason; nothing else changes. With one, it is there."""
    if _gpu_available():
        assert get_backend("cupy").name == "cupy"
        return
    with pytest.raises(BackendUnavailable, match="backend 'cupy' is unavailable") as info:
        get_backend("cupy")
    message = str(info.value)
    assert "no CUDA GPU was found" in message or "pip install 'pagedkv-np[cuda]'" in message
    with pytest.raises(BackendUnavailable):
        CupyBackend()
    assert "cupy" not in available_backends()
    assert get_backend("numpy").name == "numpy"


def test_without_nvrtc_availability_says_what_to_install(monkeypatch):
    from pagedkv_np.backends import cupy_gpu

    def missing():
        raise OSError("libnvrtc.so.13: cannot open shared object file")

    gpu_present = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setattr(cupy_gpu, "cupy", gpu_present)
    monkeypatch.setattr(cupy_gpu, "_nvrtc_version", missing)
    reason = CupyBackend.availability()
    assert "NVRTC" in reason and "pip install nvidia-cuda-nvrtc" in reason
    monkeypatch.setattr(cupy_gpu, "_nvrtc_version", lambda: (13, 0))
    assert CupyBackend.availability() is None


def test_without_cupy_get_backend_says_what_to_install():
    script = ("import sys; sys.modules['cupy'] = None\n"
              "from pagedkv_np import get_backend, BackendUnavailable, available_backends\n"
              "try:\n    get_backend('cupy')\nexcept BackendUnavailable as e:\n    print(e)\n"
              "assert 'cupy' not in available_backends()\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "CuPy is not installed" in proc.stdout
    assert "pip install 'pagedkv-np[cuda]'" in proc.stdout


# ------------------------------------------------------------- on a real GPU
gpu = pytest.mark.skipif(not _gpu_available(), reason=str(CupyBackend.availability()))


@gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 3])
def test_gpu_matches_reference(dtype, layout, page_size, head_dim):
    case = Case(dtype, layout, page_size, head_dim=head_dim)
    be = get_backend("cupy")
    k_cache, v_cache = be.asarray(case.k_cache), be.asarray(case.v_cache)
    be.write(k_cache, v_cache, 1, case.slot_mapping, be.asarray(case.k), be.asarray(case.v),
             layout=layout)
    assert_same_bits((be.to_numpy(k_cache), be.to_numpy(v_cache)),
                     ref_write(case, case.k, case.v))
    k_cache, v_cache = be.asarray(case.k_cache), be.asarray(case.v_cache)
    for out_layout in OutputLayout:
        got = be.gather(k_cache, v_cache, 1, case.page_table, case.seq_lens, layout=layout,
                        out_layout=out_layout, num_positions=case.num_positions)
        assert_same_bits([be.to_numpy(x) for x in got], ref_gather(case, out_layout))
        # Into dirty, preallocated buffers: every element is written.
        out = tuple(be.asarray(random_bits(got[0].shape, dtype, np.random.default_rng(i)))
                    for i in (3, 4))
        got = be.gather(k_cache, v_cache, 1, case.page_table, case.seq_lens, layout=layout,
                        out_layout=out_layout, out=out)
        assert_same_bits([be.to_numpy(x) for x in got], ref_gather(case, out_layout))
    be.copy_pages(k_cache, v_cache, case.src_pages, case.dst_pages, layout=layout)
    want_k, want_v = case.k_cache.copy(), case.v_cache.copy()
    NumpyBackend().copy_pages(want_k, want_v, case.src_pages, case.dst_pages, layout=layout)
    assert_same_bits((be.to_numpy(k_cache), be.to_numpy(v_cache)), (want_k, want_v))


@gpu
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 8, 3])
def test_gpu_quantized_matches_reference(dtype, layout, page_size, head_dim):
    case = QCase(dtype, layout, page_size, head_dim=head_dim)
    be, ref = get_backend("cupy"), NumpyBackend()
    want = case.stores()
    ref.write_quantized(*want, 1, case.slot_mapping, case.k, case.v, layout=layout)
    got = case.stores(be.asarray)
    be.write_quantized(*got, 1, case.slot_mapping, be.asarray(case.k), be.asarray(case.v),
                       layout=layout)
    assert_same_bits([be.to_numpy(x) for x in got], want)
    stores = case.stores(be.asarray)
    for out_layout in OutputLayout:
        for out_dtype in DTYPES:
            want = ref.gather_quantized(*case.stores(), 1, case.page_table, case.seq_lens,
                                        layout=layout, out_layout=out_layout,
                                        num_positions=case.num_positions, dtype=out_dtype)
            out = tuple(be.asarray(random_bits(want[0].shape, out_dtype,
                                               np.random.default_rng(i))) for i in (7, 8))
            got = be.gather_quantized(*stores, 1, case.page_table, case.seq_lens,
                                      layout=layout, out_layout=out_layout, out=out)
            assert_same_bits([be.to_numpy(x) for x in got], want)
    be.copy_pages(stores[0], stores[1], case.src_pages, case.dst_pages, layout=layout)
    be.copy_pages(stores[2], stores[3], case.src_pages, case.dst_pages, layout=layout)
    want = case.stores()
    ref.copy_pages(want[0], want[1], case.src_pages, case.dst_pages, layout=layout)
    ref.copy_pages(want[2], want[3], case.src_pages, case.dst_pages, layout=layout)
    assert_same_bits([be.to_numpy(x) for x in stores], want)


@gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_strided_and_host_inputs(layout):
    """Head-major k, reversed v, rows with a stride (copied first) and host
    NumPy inputs (uploaded) all write the reference's bits."""
    import cupy

    case = Case("bfloat16", layout, 16)
    be = get_backend("cupy")
    want = ref_write(case, case.k, case.v)
    k_hmajor = cupy.asarray(np.ascontiguousarray(case.k.transpose(1, 0, 2))).transpose(1, 0, 2)
    v_reversed = cupy.asarray(np.ascontiguousarray(case.v[::-1]))[::-1]
    k_spaced = cupy.asarray(np.repeat(case.k, 2, axis=2))[..., ::2]
    for k, v in ((k_hmajor, v_reversed), (k_spaced, case.v), (case.k, case.v)):
        k_cache, v_cache = be.asarray(case.k_cache), be.asarray(case.v_cache)
        be.write(k_cache, v_cache, 1, case.slot_mapping, k, v, layout=layout)
        assert_same_bits((be.to_numpy(k_cache), be.to_numpy(v_cache)), want)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_accepts_torch_cuda_tensors_in_place(dtype):
    import cupy

    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    case = Case(dtype, StoreLayout.NHD, 16)
    be = get_backend("cupy")
    k_cache, v_cache = be.asarray(case.k_cache), be.asarray(case.v_cache)
    int_dtype = np.int16 if case.k.itemsize == 2 else np.int32

    def to_torch(x):
        return torch.from_numpy(bits(x).view(int_dtype).copy()).cuda().view(getattr(torch, dtype))

    be.write(k_cache, v_cache, 1, case.slot_mapping, to_torch(case.k), to_torch(case.v))
    assert_same_bits((be.to_numpy(k_cache), be.to_numpy(v_cache)),
                     ref_write(case, case.k, case.v))
    want = ref_gather(case, OutputLayout.BHTD)
    out = tuple(to_torch(np.zeros_like(w)) for w in want)
    torch.cuda.synchronize()
    be.gather(k_cache, v_cache, 1, case.page_table, case.seq_lens, out_layout="BHTD", out=out)
    cupy.cuda.get_current_stream().synchronize()
    got = [x.view(torch.int16 if case.k.itemsize == 2 else torch.int32).cpu().numpy() for x in out]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, bits(w).view(int_dtype))
