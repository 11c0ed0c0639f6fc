"""Range checks of index arrays, and cache-line aligned host arrays.

Shared by every backend through :class:`~pagedkv_np.backends.base.Backend`:
the O(n) checks that ``check_indices=False`` skips, and the allocation that
makes host stores and gather outputs start on a cache line.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import PageIdError, PageStateError, ShapeError

__all__ = ["check_slot_mapping", "check_page_table", "check_page_pairs", "CACHE_LINE",
           "aligned_array"]


def check_slot_mapping(slot_mapping: np.ndarray, num_slots: int) -> None:
    """Check that every slot is -1 or in ``[0, num_slots)`` and none repeats."""
    if slot_mapping.size == 0:
        return
    lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
    if lo < -1 or hi >= num_slots:
        bad = lo if lo < -1 else hi
        raise PageIdError(
            f"Invalid slot_mapping: slots must be -1 or in [0, {num_slots}), got {bad}"
        )
    valid = slot_mapping[slot_mapping >= 0]
    if valid.size > 1 and np.unique(valid).size != valid.size:
        raise PageIdError("Invalid slot_mapping: a slot appears more than once")


def check_page_table(
    page_table: np.ndarray, seq_lens: np.ndarray, num_pages: int, page_size: int
) -> None:
    """Check ``seq_lens`` against the table width and that every page a
    sequence uses is in ``[0, num_pages)`` (unused entries may be -1)."""
    num_seqs, max_pages = page_table.shape
    if num_seqs == 0:
        return
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0 or hi > max_pages * page_size:
        bad = lo if lo < 0 else hi
        raise ShapeError(
            f"Invalid seq_lens: expected 0 <= len <= {max_pages * page_size} "
            f"(max_pages * page_size), got {bad}"
        )
    if page_table.size == 0:
        return
    if int(page_table.min()) < -1 or int(page_table.max()) >= num_pages:
        raise PageIdError(
            f"Invalid page_table: page ids must be -1 or in [0, {num_pages})"
        )
    pages_used = (seq_lens.astype(np.int64) + page_size - 1) // page_size
    used = np.arange(max_pages)[None, :] < pages_used[:, None]
    if (page_table[used] < 0).any():
        raise PageIdError(
            "Invalid page_table: a sequence's page within its seq_lens is -1"
        )


def check_page_pairs(src: np.ndarray, dst: np.ndarray, num_pages: int) -> None:
    """Check copy-on-write page pairs: in range, distinct destinations that are
    not also sources."""
    if src.size == 0:
        return
    for name, arr in (("src_pages", src), ("dst_pages", dst)):
        if int(arr.min()) < 0 or int(arr.max()) >= num_pages:
            raise PageIdError(f"Invalid {name}: page ids must be in [0, {num_pages})")
    if np.unique(dst).size != dst.size:
        raise PageStateError("Invalid dst_pages: a destination page appears twice")
    if np.intersect1d(src, dst).size:
        raise PageStateError("Invalid dst_pages: a page is both a source and a destination")


# Host arrays start on a cache line. NumPy's large allocations start 16 bytes
# past one, so every K/V row of a store (a multiple of 64 bytes for the usual
# head sizes) would straddle two lines, and a streaming store that fills only
# part of a line costs a read-modify-write in memory: a decode write of 32
# rows measured 3-5% slower that way.
CACHE_LINE = 64


def aligned_array(make: Any, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``make(shape, dtype)`` (``np.zeros`` or ``np.empty``) whose data starts
    on a :data:`CACHE_LINE` boundary: a view into a slightly larger buffer."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = make(nbytes + CACHE_LINE, dtype=np.uint8)
    start = -raw.ctypes.data % CACHE_LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)
