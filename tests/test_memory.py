"""Host buffers committed where written (pagedkv_np.memory): zero-filled,
writeable, page aligned, resident only in the pages touched, released with
the array, and a size that cannot be mapped is a MemoryError."""

from __future__ import annotations

import gc
import sys

import numpy as np
import pytest

from pagedkv_np.memory import LAZY_MIN_BYTES, lazy_zeros, trim_heap


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def test_a_large_buffer_is_zero_aligned_writeable_and_resident_only_where_written():
    a = lazy_zeros((64, 1024, 1024), np.float32)          # 256 MiB
    assert a.shape == (64, 1024, 1024) and a.dtype == np.float32
    assert a.flags.c_contiguous and a.flags.writeable and a.ctypes.data % 4096 == 0
    before = _resident_mib()
    for layer in range(64):                                 # one 4 KiB page of each layer
        a[layer, 0, :1024] = layer + 1
    grew = _resident_mib() - before
    assert grew < 16, f"{grew:.1f} MiB resident for 64 pages written"   # not 64 x 2 MiB
    assert a[5, 0, 0] == 6 and a[5, 1, 0] == 0 and not a[:, 2:4].any()
    del a
    gc.collect()
    assert _resident_mib() < before + 8                     # the mapping is released


def test_small_buffers_and_other_shapes():
    small = lazy_zeros((3, 4), np.int64)
    assert small.nbytes < LAZY_MIN_BYTES and not small.any() and small.flags.writeable
    assert lazy_zeros(LAZY_MIN_BYTES, np.uint8).shape == (LAZY_MIN_BYTES,)


def test_a_size_that_cannot_be_mapped_is_a_memory_error():
    with pytest.raises(MemoryError, match="cannot map"):
        lazy_zeros((2**40, 2**20), np.float32)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_heap_hands_back_what_was_freed_inside_the_heap():
    # 64 KiB blocks come from the heap (under malloc's mmap threshold); one
    # kept after them pins the heap's top, so free() alone returns nothing
    blocks = [np.ones(1 << 14, np.float32) for _ in range(1600)]     # 100 MiB
    pin = np.ones(1 << 14, np.float32)
    del blocks
    before = _rss_anon()
    assert trim_heap()
    assert before - _rss_anon() > 50 << 20
    assert pin.sum() == 1 << 14
