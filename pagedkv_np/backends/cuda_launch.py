"""Launch geometry of the CUDA kernels: word size, block shape and grid of each call.

Pure Python over shapes, strides and dtypes (no CuPy, no GPU), so that the
geometry every kernel launch gets is tested on any machine. The kernels
(``kernels/*.cu``) copy bits in words of 16, 8, 4 or 2 bytes;
:func:`word_bytes` picks the widest word that divides a row (``head_dim``
elements) and every address and stride involved.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..errors import ShapeError
from ..layout import OutputLayout, StoreLayout

__all__ = ["LaunchPlan", "word_bytes", "block_shape", "row_strides", "plan_write",
           "plan_gather", "plan_copy_pages", "plan_write_quantized", "plan_gather_quantized"]


# Threads per block, as PAGEDKV_BLOCK_THREADS in kernels/pagedkv_common.cuh
# (the kernels' __launch_bounds__).
_BLOCK_THREADS = 256
_MAX_BLOCK_Z = 64
_MAX_GRID_X = 2**31 - 1
_MAX_GRID_YZ = 65535
_INT32_MAX = 2**31 - 1
# Word sizes with an entry point in every kernel file, widest first.
_WORD_BYTES = (16, 8, 4, 2)


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def word_bytes(itemsize: int, row_bytes: int, addresses: tuple[int, ...] = (),
               strides: tuple[int, ...] = ()) -> int:
    """The widest word (16, 8, 4 or 2 bytes, never narrower than an element)
    that divides ``row_bytes`` and every address and byte stride."""
    for word in _WORD_BYTES:
        if word < itemsize:
            break
        if row_bytes % word == 0 and all(x % word == 0 for x in (*addresses, *strides)):
            return word
    return itemsize


def block_shape(row_words: int, num_heads: int) -> tuple[int, int, int]:
    """Threads per block as (x, y, z): x over the words of a row, y over heads,
    z over tokens or positions; powers of two, at most 256 in all.

    x stops at a warp, so a row wider than 32 words is walked in steps of 32
    and the rest of the block covers more heads and tokens; short rows and
    few heads leave room for many tokens per block (prefill) while a single
    token still spreads over heads and words (decode). z stops at 64, CUDA's
    limit for that axis; the smaller blocks that leaves (tiny rows, one head)
    still fill an SM, which holds 32 blocks.
    """
    x = min(32, _pow2_ceil(row_words))
    y = min(_pow2_ceil(num_heads), _BLOCK_THREADS // x)
    return x, y, min(_MAX_BLOCK_Z, _BLOCK_THREADS // (x * y))


def _i32(value: int, name: str) -> np.int32:
    if value > _INT32_MAX:
        raise ShapeError(f"Invalid {name}: {value} does not fit the kernels' int32 counts")
    return np.int32(value)


def _store_rows(page_size: int, num_heads: int, layout: StoreLayout) -> tuple[int, int, int]:
    """Strides in store rows (one head's head_dim elements, or its scales) of
    a page, an offset in a page and a head, within one layer of a
    C-contiguous store, from its shape (never from ``.strides``, which a
    contiguous array may hold arbitrary for axes of length 1)."""
    _, _, a, b, _ = layout.shape(1, 1, page_size, num_heads, 1)
    rows = (b, 1)   # the strides of axes 2 and 3
    return a * b, rows[layout.offset_axis - 2], rows[layout.head_axis - 2]


def row_strides(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int]:
    """Byte strides of the token and head axes of K/V input [N, H, D]; an
    axis of length 1 gets 0, as its index is always 0."""
    return (0 if shape[0] == 1 else int(strides[0]), 0 if shape[1] == 1 else int(strides[1]))


class LaunchPlan(NamedTuple):
    """One kernel launch, worked out on the host without touching a device.

    ``scalars`` are the kernel's arguments after its pointer arguments, as
    NumPy scalars of the exact C widths (int32/int64).
    """

    file_name: str
    entry_point: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    scalars: tuple[Any, ...]


def plan_write(layout: StoreLayout, store_shape: tuple[int, ...], itemsize: int,
               num_tokens: int, addresses: tuple[int, int, int, int],
               k_strides: tuple[int, int], v_strides: tuple[int, int]) -> LaunchPlan | None:
    """Launch of ``paged_write``; ``None`` when there is nothing to move.

    Parameters
    ----------
    layout : StoreLayout
    store_shape : tuple of 5 ints
        Shape of the C-contiguous store.
    itemsize : int
        Bytes per element (2 or 4).
    num_tokens : int
        Length of ``slot_mapping``.
    addresses : tuple of 4 ints
        Device addresses of K's layer, V's layer, k and v.
    k_strides, v_strides : tuple of 2 ints
        Byte strides of the token and head axes of k and v (rows contiguous),
        as :func:`row_strides` gives them.

    The kernel's pointer arguments, in order: K layer, V layer, k, v,
    slot_mapping.
    """
    _, _, page_size, num_heads, head_dim = layout.dims(store_shape)
    if num_tokens == 0 or num_heads * head_dim == 0:
        return None
    row_bytes = head_dim * itemsize
    in_strides = (*k_strides, *v_strides)
    word = word_bytes(itemsize, row_bytes, addresses, in_strides)
    row_words = row_bytes // word
    block = block_shape(row_words, num_heads)
    grid = (min(_ceil_div(num_tokens, block[2]), _MAX_GRID_X),
            min(_ceil_div(num_heads, block[1]), _MAX_GRID_YZ), 1)
    scalars = (_i32(num_tokens, "slot_mapping length"), np.int32(num_heads),
               np.int32(row_words), np.int32(page_size),
               *(np.int64(r * row_words) for r in _store_rows(page_size, num_heads, layout)),
               *(np.int64(s // word) for s in in_strides))
    return LaunchPlan("paged_write.cu", f"paged_write_b{word}", grid, block, scalars)


def plan_gather(layout: StoreLayout, out_layout: OutputLayout, store_shape: tuple[int, ...],
                itemsize: int, num_seqs: int, max_pages: int, num_positions: int,
                addresses: tuple[int, int, int, int]) -> LaunchPlan | None:
    """Launch of ``paged_gather``; ``None`` when the output is empty.

    ``addresses`` are those of K's layer, V's layer and the two C-contiguous
    outputs ([num_seqs, num_positions, H, D] for BTHD, [num_seqs, H,
    num_positions, D] for BHTD). The kernel's pointer arguments, in order:
    K layer, V layer, k_out, v_out, page_table ([num_seqs, max_pages],
    C-contiguous), seq_lens.
    """
    _, _, page_size, num_heads, head_dim = layout.dims(store_shape)
    if num_seqs * num_positions * num_heads * head_dim == 0:
        return None
    row_bytes = head_dim * itemsize
    _, a, b, _ = out_layout.shape(num_seqs, num_positions, num_heads, head_dim)
    axes = (a * b * row_bytes, b * row_bytes, row_bytes)   # strides of axes 0, 1, 2
    t_axis = out_layout.t_axis
    out_strides = (axes[0], axes[t_axis], axes[3 - t_axis])   # (seq, position, head)
    word = word_bytes(itemsize, row_bytes, addresses)
    row_words = row_bytes // word
    block = block_shape(row_words, num_heads)
    grid = (min(_ceil_div(num_positions, block[2]), _MAX_GRID_X),
            min(num_seqs, _MAX_GRID_YZ),
            min(_ceil_div(num_heads, block[1]), _MAX_GRID_YZ))
    scalars = (_i32(num_seqs, "page_table rows"), _i32(max_pages, "page_table columns"),
               _i32(num_positions, "out positions"), np.int32(num_heads),
               np.int32(row_words), np.int32(page_size),
               *(np.int64(r * row_words) for r in _store_rows(page_size, num_heads, layout)),
               *(np.int64(s // word) for s in out_strides))
    return LaunchPlan("paged_gather.cu", f"paged_gather_b{word}", grid, block, scalars)


def plan_copy_pages(store_shape: tuple[int, ...], itemsize: int, num_pairs: int,
                    addresses: tuple[int, int]) -> LaunchPlan | None:
    """Launch of ``copy_pages``; ``None`` when there is nothing to copy.

    ``addresses`` are those of the whole K and V stores. The kernel's pointer
    arguments, in order: K store, V store, src_pages, dst_pages.
    """
    num_layers, num_pages = store_shape[:2]
    page_bytes = int(np.prod(store_shape[2:])) * itemsize
    if num_pairs == 0 or num_layers * page_bytes == 0:
        return None
    word = word_bytes(itemsize, page_bytes, addresses)
    page_words = page_bytes // word
    threads = min(_BLOCK_THREADS, 32 * _ceil_div(page_words, 32))
    grid = (min(_ceil_div(page_words, threads), _MAX_GRID_X),
            min(num_pairs, _MAX_GRID_YZ), min(num_layers, _MAX_GRID_YZ))
    scalars = (_i32(num_pairs, "src_pages length"), np.int32(num_layers),
               np.int64(num_pages * page_words), np.int64(page_words))
    return LaunchPlan("copy_pages.cu", f"copy_pages_b{word}", grid, (threads, 1, 1), scalars)


def _kind_suffix(dtype: Any) -> str:
    """Entry point suffix of paged_quant.cu for K/V of ``dtype``."""
    dtype = np.dtype(dtype)
    if dtype.itemsize == 4:
        return "f32"
    return "f16" if dtype == np.dtype(np.float16) else "bf16"


def plan_write_quantized(layout: StoreLayout, store_shape: tuple[int, ...], dtype: Any,
                         num_tokens: int, group: int, k_strides: tuple[int, int],
                         v_strides: tuple[int, int]) -> LaunchPlan | None:
    """Launch of ``paged_write_q``; ``None`` when there is nothing to move.

    Parameters
    ----------
    store_shape : tuple of 5 ints
        Shape of the C-contiguous int8 code store.
    dtype : numpy dtype
        dtype of k and v (float32, float16 or bfloat16).
    group : int
        Values per scale (see :func:`pagedkv_np.quant.group_size`).
    k_strides, v_strides : tuple of 2 ints
        Byte strides of the token and head axes of k and v (rows contiguous).

    The kernel's pointer arguments, in order: K codes' layer, V codes' layer,
    K scales' layer, V scales' layer, k, v, slot_mapping.
    """
    _, _, page_size, num_heads, head_dim = layout.dims(store_shape)
    num_groups = head_dim // group
    work = num_tokens * num_heads * num_groups
    if work == 0:
        return None
    itemsize = np.dtype(dtype).itemsize
    grid = (min(_ceil_div(work, _BLOCK_THREADS), _MAX_GRID_X), 1, 1)
    scalars = (_i32(num_tokens, "slot_mapping length"), np.int32(num_heads),
               np.int32(head_dim), np.int32(group), np.int32(page_size),
               *(np.int64(r) for r in _store_rows(page_size, num_heads, layout)),
               *(np.int64(s // itemsize) for s in (*k_strides, *v_strides)))
    return LaunchPlan("paged_quant.cu", f"paged_write_q_{_kind_suffix(dtype)}", grid,
                      (_BLOCK_THREADS, 1, 1), scalars)


def plan_gather_quantized(layout: StoreLayout, out_layout: OutputLayout,
                          store_shape: tuple[int, ...], dtype: Any, num_seqs: int,
                          max_pages: int, num_positions: int, group: int) -> LaunchPlan | None:
    """Launch of ``paged_gather_q`` into C-contiguous outputs of ``dtype``;
    ``None`` when the output is empty. The kernel's pointer arguments, in
    order: K codes' layer, V codes' layer, K scales' layer, V scales' layer,
    k_out, v_out, page_table ([num_seqs, max_pages], C-contiguous), seq_lens.
    """
    _, _, page_size, num_heads, head_dim = layout.dims(store_shape)
    work = num_seqs * num_positions * num_heads * head_dim
    if work == 0:
        return None
    grid = (min(_ceil_div(work, _BLOCK_THREADS), _MAX_GRID_X), 1, 1)
    scalars = (_i32(num_seqs, "page_table rows"), _i32(max_pages, "page_table columns"),
               _i32(num_positions, "out positions"), np.int32(num_heads), np.int32(head_dim),
               np.int32(group), np.int32(page_size),
               np.int32(out_layout is OutputLayout.BHTD),
               *(np.int64(r) for r in _store_rows(page_size, num_heads, layout)))
    return LaunchPlan("paged_quant.cu", f"paged_gather_q_{_kind_suffix(dtype)}", grid,
                      (_BLOCK_THREADS, 1, 1), scalars)
